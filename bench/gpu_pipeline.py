"""bench.gpu's pipeline rows: `tandem serve` on the 8B shapes, its start-up, whole workloads
first and warm, and one stream's batch-1 decode rate."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu_measure import BATCH1_RUNS, random_prompt
from bench.gpu_table import row
from bench.pipeline import through_pipeline


def run_pipeline(
    c: Any,
    steps: int,
    out_len: int,
    roofline_b1: float,
    concurrencies: list[int],
    floors: dict[int, tuple[float, float]],
    system: str = "tandem pipeline",
    *extra: str,
) -> None:
    """`floors`: each workload's floor at the burst's and the held matmul rate, tok/s (the
    in-process rows measured them); `extra`: more flags of `tandem serve`, the rows' system
    named `system`."""
    from harness.pipeline import pipeline

    log_dir = Path(tempfile.mkdtemp(prefix="tandem-gpu-"))
    flags = (
        "--model",
        "llama3-8b-random",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--kv-cache-mb",
        "40000",
        "--max-num-seqs",
        "256",
        "--ready-timeout",
        "600",
        *extra,
    )
    try:
        started = time.perf_counter()
        with pipeline(log_dir, *flags) as served:
            row("8B start-up (until ready)", system, time.perf_counter() - started, "s")
            for k, n in enumerate(concurrencies):
                for j, label in enumerate(("first run", "warm")):
                    # Other prompts each run: the scheduler's prefix cache outlives a run.
                    seed = 1000 * (2 * k + j + 1)
                    prompts = [random_prompt(512, c.vocab_size, seed + i) for i in range(n)]
                    run = asyncio.run(
                        through_pipeline(
                            served.address, served.scheduler_address, "pipeline", prompts,
                            out_len, n, warm_up=False,
                        )
                    )  # fmt: skip
                    row(
                        f"8B workload, {n} requests",
                        f"{system}, {label}",
                        run.tokens_per_s,
                        "tok/s",
                        *floors.get(n, (0.0, 0.0)),
                        ttft_p50_ms=run.ttft_p50_ms,
                        ttft_p99_ms=run.ttft_p99_ms,
                        itl_p50_ms=run.itl_p50_ms,
                        itl_p99_ms=run.itl_p99_ms,
                        hop_p50_us=run.hop_p50_us,
                        hop_p99_us=run.hop_p99_us,
                    )
            streams = [
                asyncio.run(
                    through_pipeline(
                        served.address, served.scheduler_address, "pipeline",
                        [random_prompt(512, c.vocab_size, 200 + i)], steps, 1,
                    )
                )
                for i in range(BATCH1_RUNS)
            ]  # fmt: skip
            streams.sort(key=lambda one: one.decode_tokens_per_s)
            one = streams[len(streams) // 2]
            # The stream's decode rate: its tokens arrive ±0.3 ms around the step time (the hops
            # after the worker), so the median gap is a noisier measure of the same rate.
            row(
                "8B batch-1 decode",
                system,
                one.decode_tokens_per_s,
                "tok/s",
                roofline_b1,
                itl_p50_ms=one.itl_p50_ms,
                hop_p50_us=one.hop_p50_us,
                hop_p99_us=one.hop_p99_us,
                runs_tok_s=[s.decode_tokens_per_s for s in streams],
            )
    finally:
        for log in log_dir.glob("*.log"):
            print(log.read_text()[-4000:], flush=True)

"""tandem on one GPU against the hardware's limits and Hugging Face transformers, in one run.

    python -m bench.gpu [--json PATH] [--quick] [--skip-pipeline] [--skip-hf]

On the same random weights of the LLaMA-3-8B shapes (bf16): the engine's start-up; whole workloads
of 8, 64 and 256 requests at once (prompt 512, output 256; the scheduler's policy and the engine in
one loop, bench/serving.py), first after the start and warm, against the workload's floor, with
where a step's time goes; batch-1 decode against the HBM roofline (the weights' bytes a step reads ÷
a device-to-device copy bandwidth measured here); decode steps alone at 8, 64 and 256 sequences
against the step roofline; TTFT of a 2,048-token prompt (to an idle server, and back to back)
against the compute floor (the FLOPs of the layers for every token and the head for the last ÷ a
matmul rate measured here); the pipeline's start-up, its workloads of 64 and 256 requests (first and
warm) and batch-1 decode; INT8 weights; transformers `generate` (eager and static cache); and the
default model SmolLM2. Prints one table and writes JSON.

Each row also gets the SM clock and power the card ran at (`nvidia-smi` every 50 ms, from the row
before it to its own end), printed as a second table: an H200 at its 700 W limit lowers its clock.

The matmul rate is measured twice: in a 14 ms burst, and held for 8 s. Held, an H200 reaches its
power limit and lowers its clock, so the rows whose floor counts prefill FLOPs (workloads, TTFT)
show their ratio to both floors.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this benchmark as a module: python -m bench.gpu")

import argparse
import json
import platform
import shlex
import time
from pathlib import Path
from typing import Any

import torch

from bench.cli import first_paragraph, json_option, tandem_home
from bench.gpu_clock import parse_samples, sampling
from bench.gpu_fp8 import measure_fp8
from bench.gpu_hf import hf_generate, hf_model
from bench.gpu_measure import (
    BATCH1_RUNS,
    batch1_decode,
    batch1_steps,
    copy_bandwidth,
    decode_steps,
    free,
    graph_only,
    matmul_rate,
    prefill_params,
    random_prompt,
    sustained_matmul_rate,
    ttft,
    weight_bytes,
)
from bench.gpu_pipeline import run_pipeline
from bench.gpu_table import RATES, ROWS, begin, row, show_clock, show_steps
from bench.serving import run_workload, summarize_steps, workload_floor
from engine import registry
from engine.engine import Engine

# requests -> the 8B workload's floor at the burst's and the held matmul rate, tok/s: the
# in-process rows measure them, the pipeline's are reported against them.
FLOORS: dict[int, tuple[float, float]] = {}


def measure_8b(
    path: Path,
    bandwidth: float,
    flops: float,
    sustained_flops: float,
    steps: int,
    out_len: int,
    concurrencies: list[int],
    skip_hf: bool,
) -> tuple[int, Any]:
    """Everything on the bf16 engine (and transformers) of the 8B shapes; frees it on return."""
    started = time.perf_counter()
    engine = Engine.from_path(
        path, "cuda", "bfloat16", kv_cache_bytes=48 << 30, progress=False, max_num_seqs=256
    )
    row(
        "8B start-up (load, graphs, warm-up)",
        "tandem engine",
        time.perf_counter() - started,
        "s",
        **{f"{k}_s": v for k, v in engine.start_times.items()},
    )
    wbytes = weight_bytes(engine)
    c = engine.config
    params = prefill_params(engine)
    roofline_b1 = bandwidth / wbytes
    for k, n in enumerate(concurrencies):
        prompts = [random_prompt(512, c.vocab_size, 100 + i) for i in range(n)]
        floor = workload_floor(c, params, wbytes, [512] * n, out_len, flops, bandwidth)
        held = workload_floor(c, params, wbytes, [512] * n, out_len, sustained_flops, bandwidth)
        for label in ("first after start" if k == 0 else "first of its size", "warm"):
            run = run_workload(engine, prompts, out_len)
            FLOORS[n] = (run.output_tokens / floor, run.output_tokens / held)
            row(
                f"8B workload, {n} requests",
                f"tandem engine, {label}",
                run.tokens_per_s,
                "tok/s",
                *FLOORS[n],
                compiles=run.compiles,
                steps=summarize_steps(run.steps, n),
            )
            show_steps(run.steps, n)
    runs = [sorted(batch1_steps(engine, 512, steps)) for _ in range(BATCH1_RUNS)]
    medians = sorted(1 / t[len(t) // 2] for t in runs)
    means = sorted(len(t) / sum(t) for t in runs)
    row(
        "8B batch-1 decode",
        "tandem engine (graphs)",
        medians[len(medians) // 2],
        "tok/s",
        roofline_b1,
        # The pipeline's row is a stream's mean rate: this is the one to set beside it.
        mean_tok_s=means[len(means) // 2],
        runs_mean_tok_s=means,
    )
    engine.replay_ahead = False
    row(
        "8B batch-1 decode",
        "tandem engine, no replay-ahead",
        batch1_decode(engine, 512, steps),
        "tok/s",
        roofline_b1,
    )
    engine.replay_ahead = True
    engine.greedy_in_graph = False
    row(
        "8B batch-1 decode",
        "tandem engine, sampling outside graph",
        batch1_decode(engine, 512, steps),
        "tok/s",
        roofline_b1,
    )
    engine.greedy_in_graph = True
    row(
        "8B batch-1 decode",
        "graph replay alone",
        graph_only(engine, 512, steps),
        "tok/s",
        roofline_b1,
    )
    kv_per_token = 2 * c.n_layers * c.kv_dim * 2
    for n in concurrencies:
        # Step roofline: weights once, plus each sequence's KV read, at mid-generation length.
        step_bytes = wbytes + n * (512 + out_len // 2) * kv_per_token
        for overlapped in (False, True):
            row(
                f"8B decode steps, {n} seqs",
                "tandem engine, overlapped" if overlapped else "tandem engine",
                decode_steps(engine, n, 512 + out_len // 2, min(steps, 64), overlapped),
                "tok/s",
                n * bandwidth / step_bytes,
            )
    attention_flops = 2 * c.n_layers * 2048 * 2048 * c.q_dim  # QK^T and PV, causal half each
    prefill_flops = 2 * params[0] * 2048 + 2 * params[1] + attention_flops
    # An idle card starts a prompt at its boost clock: the burst's floor alone. Back to back,
    # it runs at its power limit: both floors.
    for label, rest in (("idle server, 1 s apart", 1.0), ("back to back", 0.0)):
        times = ttft(engine, 2048, rest=rest)
        row(
            f"8B TTFT, 2048-token prompt (median of 5, {label})",
            "tandem engine",
            times[len(times) // 2] * 1000,
            "ms",
            prefill_flops / flops * 1000,
            0.0 if rest else prefill_flops / sustained_flops * 1000,
            all_ms=[t * 1000 for t in times],
        )
    # Its own pool, just big enough: a second 48 GiB one would not fit beside the first on an
    # 80 GB card.
    eager_blocks = -(-(512 + steps) // engine.block_size) + 1
    eager = Engine(engine.loaded, eager_blocks, engine.block_size, 256, cuda_graphs=False)
    begin()
    row(
        "8B batch-1 decode",
        "tandem engine (eager)",
        batch1_decode(eager, 512, steps // 2),
        "tok/s",
        roofline_b1,
    )
    del eager
    if not skip_hf:
        hf = hf_model(path, c)
        begin()
        for static in (False, True):
            label = "transformers (static, no compile)" if static else "transformers (eager)"
            row(
                "8B batch-1 decode",
                label,
                hf_generate(hf, 1, 512, 32, static),
                "tok/s",
                roofline_b1,
            )
            row("8B aggregate, 64 seqs", label, hf_generate(hf, 64, 512, 64, static), "tok/s")
    return wbytes, c


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    json_option(parser, "gpu.json")
    parser.add_argument("--quick", action="store_true", help="fewer steps, smaller batches")
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument(
        "--pipeline-ab",
        action="store_true",
        help="the pipeline rows again with --no-overlap-steps (the worker's overlap, A/B)",
    )
    parser.add_argument(
        "--pipeline-also",
        action="append",
        default=[],
        metavar="FLAGS",
        help="the pipeline rows again with these flags of `tandem serve` added (repeatable), "
        'e.g. --pipeline-also="--max-num-batched-tokens 8192"',
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-int8", action="store_true")
    parser.add_argument("--skip-fp8", action="store_true")
    parser.add_argument("--only-fp8", action="store_true", help="the FP8 rows alone")
    parser.add_argument("--skip-smollm", action="store_true")
    parser.add_argument("--skip-8b", action="store_true", help="only the default model's rows")
    args = parser.parse_args()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    clock_log = args.json.with_suffix(".clock.csv")
    with sampling(clock_log):
        started = time.time()
        measure(args)
    samples = parse_samples(clock_log.read_text().splitlines()) if clock_log.exists() else []
    show_clock(samples, started)
    args.json.write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "host": platform.node(),
                "date": time.strftime("%Y-%m-%d"),
                **RATES,
                "rows": ROWS,
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}")


def measure(args: argparse.Namespace) -> None:
    home = tandem_home()
    steps = 32 if args.quick else 128
    out_len = 64 if args.quick else 256
    concurrencies = [8, 64] if args.quick else [8, 64, 256]

    bandwidth, flops = copy_bandwidth(), matmul_rate()
    sustained = sustained_matmul_rate()
    print(
        f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, "
        f"bf16 matmul {flops / 1e12:.0f} TFLOP/s (held 8 s: {sustained / 1e12:.0f}), "
        f"torch {torch.__version__}",
        flush=True,
    )
    print(f"{'case':<34} {'system':<26} {'value':>10} {'unit':<8} of ceiling")

    path = registry.resolve("llama3-8b-random", home)
    if args.only_fp8:
        args.skip_8b = args.skip_smollm = True
    if not args.skip_fp8 and not (args.skip_8b and not args.only_fp8):
        measure_fp8(path, bandwidth, flops, steps, out_len, [n for n in concurrencies if n >= 64])
        free()
    if not args.skip_8b:
        wbytes, c = measure_8b(
            path, bandwidth, flops, sustained, steps, out_len, concurrencies, args.skip_hf
        )
        free()
        roofline_b1 = bandwidth / wbytes
    else:
        args.skip_int8 = args.skip_pipeline = True
        wbytes = 0

    if not args.skip_int8:
        int8 = Engine.from_path(
            path,
            "cuda",
            "bfloat16",
            kv_cache_bytes=4 << 30,
            progress=False,
            max_num_seqs=1,
            quantize="int8",
        )
        begin()
        row(
            "8B batch-1 decode",
            "tandem engine int8",
            batch1_decode(int8, 512, steps),
            "tok/s",
            bandwidth / weight_bytes(int8),
        )
        if int8.graphs is not None:
            int8.graphs.use_row_kernels(False)
            row(
                "8B batch-1 decode",
                "tandem engine int8, modules",
                batch1_decode(int8, 512, steps),
                "tok/s",
                bandwidth / weight_bytes(int8),
            )
        del int8
        free()

    if not args.skip_pipeline:
        runs: list[tuple[str, ...]] = [("tandem pipeline",)]
        if args.pipeline_ab:
            runs.append(("tandem pipeline, no overlap", "--no-overlap-steps"))
        runs += [(f"tandem pipeline, {flags}", *shlex.split(flags)) for flags in args.pipeline_also]
        for system, *extra in runs:
            try:
                sizes = [n for n in concurrencies if n >= 64]
                run_pipeline(c, steps, out_len, roofline_b1, sizes, FLOORS, system, *extra)
            except Exception as err:  # a broken pipeline must not lose the other measurements
                print(f"pipeline run failed: {err!r}", flush=True)
                ROWS.append({"case": "pipeline", "system": system, "error": repr(err)})

    if not args.skip_smollm:
        small = Engine.from_path(
            registry.resolve(registry.DEFAULT_MODEL, home),
            "cuda",
            "bfloat16",
            kv_cache_bytes=8 << 30,
            progress=False,
        )
        row(
            "SmolLM2 batch-1 decode",
            "tandem engine (graphs)",
            batch1_decode(small, 512, steps),
            "tok/s",
            bandwidth / weight_bytes(small),
        )
        prompts = [random_prompt(512, small.config.vocab_size, 100 + i) for i in range(64)]
        row(
            "SmolLM2 workload, 64 requests",
            "tandem engine",
            run_workload(small, prompts, out_len).tokens_per_s,
            "tok/s",
        )
        del small
        free()

    RATES.update(
        copy_bandwidth_bytes_per_s=bandwidth,
        bf16_matmul_flops=flops,
        bf16_matmul_flops_sustained=sustained,
        weight_bytes_8b=wbytes,
    )


if __name__ == "__main__":
    main()

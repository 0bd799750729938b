"""bench.gpu's FP8 rows: FP8 weights, then FP8 weights and an FP8 KV cache, on the 8B shapes."""

from __future__ import annotations

from pathlib import Path

from bench.gpu_measure import (
    batch1_decode,
    decode_steps,
    fp8_matmul_rate,
    free,
    random_prompt,
    ttft,
    weight_bytes,
)
from bench.gpu_table import row
from bench.serving import run_workload, summarize_steps, workload_floor
from engine.engine import Engine


def measure_fp8(
    path: Path, bandwidth: float, flops: float, steps: int, out_len: int, concurrencies: list[int]
) -> None:
    """FP8 weights, then FP8 weights and an FP8 KV cache, on the 8B shapes: batch-1 decode,
    TTFT and warm whole workloads, each against its own floor (FP8's bytes and GEMM rate)."""
    fp8_flops = fp8_matmul_rate()
    row("FP8 GEMM rate (8192³, row-wise scales)", "torch._scaled_mm", fp8_flops / 1e12, "TFLOP/s")
    for kv in ("auto", "fp8"):
        engine = Engine.from_path(
            path,
            "cuda",
            "bfloat16",
            kv_cache_bytes=48 << 30,
            progress=False,
            max_num_seqs=256,
            quantize="fp8",
            kv_cache_dtype=kv,
        )
        label = "tandem engine fp8" + (" + fp8 KV" if kv == "fp8" else "")
        row("8B fp8 start-up (load, graphs, warm-up)", label, sum(engine.start_times.values()), "s")
        wbytes = weight_bytes(engine)
        c = engine.config
        # Projections multiply at the FP8 rate; the head (bf16, the last row) and attention
        # at bf16's.
        projections = sum(
            b.numel() for n, b in engine.model.named_buffers() if n.endswith("weight")
        )
        head = engine.model.output.weight.numel()
        if kv == "auto":
            row(
                "8B batch-1 decode",
                label,
                batch1_decode(engine, 512, steps),
                "tok/s",
                bandwidth / wbytes,
            )
            attention_flops = 2 * c.n_layers * 2048 * 2048 * c.q_dim
            floor = (2 * projections * 2048) / fp8_flops + (2 * head + attention_flops) / flops
            times = ttft(engine, 2048)
            row(
                "8B TTFT, 2048-token prompt (median of 5)",
                label,
                times[len(times) // 2] * 1000,
                "ms",
                floor * 1000,
                all_ms=[t * 1000 for t in times],
            )
        kv_bytes = 1 if kv == "fp8" else 2
        for n in concurrencies:
            prompts = [random_prompt(512, c.vocab_size, 100 + i) for i in range(n)]
            run_workload(engine, prompts, out_len)  # first of its size: compiles, if any
            run = run_workload(engine, prompts, out_len)
            prefill = n * (2 * projections * 512 / fp8_flops + 2 * head / flops)
            floor = prefill + workload_floor(
                c, (0, 0), wbytes, [512] * n, out_len, flops, bandwidth, kv_bytes
            )
            row(
                f"8B workload, {n} requests",
                f"{label}, warm",
                run.tokens_per_s,
                "tok/s",
                run.output_tokens / floor,
                compiles=run.compiles,
                steps=summarize_steps(run.steps, n),
            )
        step_bytes = wbytes + 256 * (512 + out_len // 2) * 2 * c.n_layers * c.kv_dim * kv_bytes
        row(
            "8B decode steps, 256 seqs",
            label,
            decode_steps(engine, 256, 512 + out_len // 2, min(steps, 64)),
            "tok/s",
            256 * bandwidth / step_bytes,
        )
        del engine
        free()

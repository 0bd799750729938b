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
import asyncio
import gc
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.cli import json_option, tandem_home
from bench.gpu_clock import Sample, by_row, parse_samples, sampling
from bench.gpu_measure import (
    batch1_decode,
    batch1_steps,
    copy_bandwidth,
    fp8_matmul_rate,
    graph_only,
    matmul_rate,
    prefill_params,
    random_prompt,
    sustained_matmul_rate,
    weight_bytes,
)
from bench.pipeline import through_pipeline
from bench.serving import run_workload, summarize_steps, workload_floor
from engine import registry
from engine.batch import FROM_LAST_STEP, SeqInput
from engine.engine import Engine
from engine.random_weights import RandomWeights

ROWS: list[dict[str, Any]] = []
RATES: dict[str, float] = {}  # the hardware's, as measured at the start
BEGUN: list[float] = []  # when the next row's measurement began, where set up came before it
FLOORS: dict[int, float] = {}  # requests -> the 8B workload's floor, tok/s
SUSTAINED_FLOORS: dict[int, float] = {}  # the same at the sustained matmul rate
BATCH1_RUNS = 3  # of the engine's and the pipeline's batch-1 rows, the median run shown


def show_steps(records: list[Any], n: int) -> None:
    """One line: where a decode step of n rows and the prefill steps spent their time (µs)."""
    s = summarize_steps(records, n)
    parts = []
    for kind in ("decode", "prefill"):
        if f"{kind}_steps" not in s:
            continue
        host = " ".join(
            f"{name} {s[f'{kind}_{name}_us']:.0f}"
            for name in ("schedule", "inputs", "prepare", "sample", "outputs", "update")
        )
        parts.append(
            f"{kind} x{s[f'{kind}_steps']:.0f}: wall {s[f'{kind}_wall_us']:.0f} busy "
            f"{s[f'{kind}_busy_us']:.0f} idle {s[f'{kind}_idle_us']:.0f} ({host}) "
            f"total {s[f'{kind}_total_s']:.2f}s"
        )
    print("    " + " | ".join(parts), flush=True)


def begin() -> None:
    """The next row's measurement starts now: its clock window leaves out the set-up before."""
    BEGUN[:] = [time.time()]


def row(
    case: str,
    system: str,
    value: float,
    unit: str,
    ceiling: float = 0.0,
    sustained: float = 0.0,
    **extra: Any,
) -> None:
    """`ceiling` at the measured rates; `sustained`, where prefill FLOPs count, the same ceiling
    with them at the matmul rate the card holds (bench.gpu_measure.sustained_matmul_rate)."""
    ratio = value / ceiling if ceiling else None
    held = value / sustained if sustained else None
    if unit == "ms" and ratio is not None:
        shown = f"{ratio:5.2f}x floor"
        shown += f" (sustained: {held:4.2f}x)" if held is not None else ""
    elif ratio is not None:
        shown = f"{ratio:6.1%}"
        shown += f" (sustained: {held:.1%})" if held is not None else ""
    else:
        shown = ""
    ROWS.append(
        {
            "case": case,
            "system": system,
            "value": value,
            "unit": unit,
            "ceiling": ceiling or None,
            "ratio": ratio,
            **({"sustained_ceiling": sustained, "sustained_ratio": held} if sustained else {}),
            **extra,
            # Its window of the clock samples: from the row before it (or begin()) to here.
            "began_at": BEGUN.pop() if BEGUN else None,
            "ended_at": time.time(),
        }
    )
    print(f"{case:<34} {system:<26} {value:>10.1f} {unit:<8} {shown}", flush=True)


def hf_model(path: Path, engine_config: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    source = RandomWeights(engine_config, 0, torch.device("cuda"), torch.bfloat16)
    model.load_state_dict({n: source.get(n) for n in source.names()}, assign=True, strict=False)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config, device="cuda")
    return model.eval()


def hf_generate(model: Any, batch: int, prompt_len: int, new: int, static: bool) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device="cuda")
    kwargs: dict[str, Any] = dict(
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        attention_mask=torch.ones_like(ids),
        pad_token_id=0,
    )
    if static:
        # A static cache without torch.compile, which would add minutes of compiling here.
        kwargs["cache_implementation"] = "static"
        kwargs["disable_compile"] = True
    with torch.no_grad():
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - start)


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def ttft(engine: Engine, prompt_len: int, repeats: int = 5, rest: float = 0.0) -> list[float]:
    """Seconds from the step's call to its token on the host, `repeats` times, sorted. With
    `rest`, that many idle seconds before each: the prompt of an idle server, at the clock an
    idle card starts from, where back to back the card runs at its power limit."""
    ids = random_prompt(prompt_len, engine.config.vocab_size, 2)
    table = list(range(-(-prompt_len // engine.block_size)))
    engine.step([SeqInput("warm", ids, 0, table)])
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        time.sleep(rest)
        start = time.perf_counter()
        engine.step([SeqInput("t", ids, 0, table)])  # one host sync inside: the token is back
        times.append(time.perf_counter() - start)
    return sorted(times)


def decode_steps(
    engine: Engine, n: int, context: int, steps: int, overlapped: bool = False
) -> float:
    """Tokens/s of decode steps alone with n sequences at `context` tokens: the step the step
    roofline describes, without the prefills and scheduling of a whole workload around it.
    The steps' contexts grow one token a step, centred on `context` (their mean is context +
    0.5), so the roofline's KV bytes are the ones they read. One step at a time (the median
    step), or `overlapped` as the worker runs them: each step submitted before the one before
    it is collected (the mean over all steps)."""
    prompt = context - steps // 2
    blocks = -(-(prompt + steps + 1) // engine.block_size)
    seqs = [(f"s{i}", list(range(i * blocks, (i + 1) * blocks))) for i in range(n)]
    vocab = engine.config.vocab_size
    for first in range(0, n, 8):  # prefill in groups: bounded activations
        engine.step(
            [
                SeqInput(seq_id, random_prompt(prompt, vocab, 200 + i), 0, t)
                for i, (seq_id, t) in enumerate(seqs[first : first + 8], start=first)
            ]
        )
    if overlapped:
        start = time.perf_counter()
        pending = None
        for step in range(steps):
            token = FROM_LAST_STEP if step else 1  # the prefills sampled in groups
            batch = [SeqInput(s, [token], prompt + step, t) for s, t in seqs]
            queued = engine.submit(batch)
            if pending is not None:
                engine.collect(pending)
            pending = queued
        assert pending is not None
        engine.collect(pending)
        engine.release(s for s, _ in seqs)
        return n * steps / (time.perf_counter() - start)
    tokens = [1] * n
    times = []
    for step in range(steps):
        batch = [SeqInput(s, [tokens[i]], prompt + step, t) for i, (s, t) in enumerate(seqs)]
        start = time.perf_counter()
        tokens = [o.token_id for o in engine.step(batch)]  # one host sync inside
        times.append(time.perf_counter() - start)
    engine.release(s for s, _ in seqs)
    times.sort()
    return n / times[len(times) // 2]


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
            FLOORS[n] = run.output_tokens / floor
            SUSTAINED_FLOORS[n] = run.output_tokens / held
            row(
                f"8B workload, {n} requests",
                f"tandem engine, {label}",
                run.tokens_per_s,
                "tok/s",
                FLOORS[n],
                SUSTAINED_FLOORS[n],
                compiles=run.compiles,
                steps=summarize_steps(run.steps, n),
            )
            show_steps(run.steps, n)
    # Three runs, the median shown: one run's rate moves by ±1.5% with the clock the power
    # limit leaves (bench/RESULTS-gpu.md, session 47), the engine's and the pipeline's alike.
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
    eager = Engine(engine.loaded, engine.num_kv_blocks, engine.block_size, 256, cuda_graphs=False)
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


def run_pipeline(
    c: Any,
    steps: int,
    out_len: int,
    roofline_b1: float,
    concurrencies: list[int],
    system: str = "tandem pipeline",
    *extra: str,
) -> None:
    """`extra`: more flags of `tandem serve`, the rows' system named `system`."""
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
                        FLOORS.get(n, 0.0),
                        SUSTAINED_FLOORS.get(n, 0.0),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    json_option(parser, "gpu.json")
    parser.add_argument("--quick", action="store_true", help="fewer steps, smaller batches")
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument(
        "--pipeline-ab",
        action="store_true",
        help="the pipeline rows again with --no-overlap-steps (the worker's overlap, A/B)",
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


def show_clock(samples: list[Sample], started: float) -> None:
    """Each row's SM clock and power (nvidia-smi, every 50 ms) from the row before it to its own
    end, into the row and as a table: where the power limit slowed the clock, it names it."""
    if not samples:
        return
    print(f"\n{'case':<34} {'system':<26} {'SM MHz':>7} {'W':>5}  clock reasons")
    spans = [(r["began_at"], r["ended_at"]) for r in ROWS]
    for r, w in zip(ROWS, by_row(samples, started, spans), strict=True):
        r.update(w)
        if w:
            reasons = ", ".join(w["clock_reasons"]) or "none"
            clock = f"{w['sm_mhz']:7.0f} {w['watts']:5.0f}"
            print(f"{r['case']:<34} {r['system']:<26} {clock}  {reasons}")


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
        runs = [("tandem pipeline",)]
        if args.pipeline_ab:
            runs.append(("tandem pipeline, no overlap", "--no-overlap-steps"))
        for system, *extra in runs:
            try:
                sizes = [n for n in concurrencies if n >= 64]
                run_pipeline(c, steps, out_len, roofline_b1, sizes, system, *extra)
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

"""What the GPU benchmarks measure with, in one place: the device's ceilings (a copy's bandwidth, a
matmul's rate, in a burst and held), an engine's weight bytes, batch-1 decode through the engine
and through its captured graph alone, a prompt's time to its first token, and decode steps of
many sequences. Imports engine code only, so a benchmark built on it
runs on a GPU image without the services' packages (bench/gpu_70b.py)."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from engine.batch import FROM_LAST_STEP, SeqInput
from engine.engine import Engine

# Batch-1 runs of a row, the median shown: one run's rate moves by ±1.5% with the clock the power
# limit leaves (bench/RESULTS-gpu.md, session 47), the engine's and the pipeline's alike.
BATCH1_RUNS = 3


def timed(fn: Any, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def copy_bandwidth() -> float:
    """Bytes read + written per second by a device-to-device copy of 4 GiB."""
    src = torch.empty(1 << 32, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src))
    return 2 * (1 << 32) / seconds


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    seconds = timed(lambda: a @ b)
    return 2 * 8192**3 / seconds


def held_matmul_rates(seconds: float) -> list[float]:
    """FLOP/s of windows of 50 back-to-back 8192³ bf16 products, for `seconds`."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rates: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or not rates:
        rates.append(2 * 8192**3 / timed(lambda: a @ b, 50))
    return rates


def sustained_matmul_rate(seconds: float = 8.0) -> float:
    """The same product's rate held for `seconds` (the median window). `matmul_rate` times 14 ms
    at the boost clock; held longer, an H200's tensor cores reach its 700 W power limit and the
    clock falls (bench/power_limit.py). A workload of seconds gets this rate, not the burst's."""
    return statistics.median(held_matmul_rates(seconds))


def fp8_matmul_rate() -> float:
    """The FP8 GEMM's rate as Fp8Linear calls it: e4m3 operands, row-wise scales, bf16 out."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(8192, 1, device="cuda")
    sb = torch.ones(1, 8192, device="cuda")
    seconds = timed(
        lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    )
    return 2 * 8192**3 / seconds


def weight_bytes(engine: Engine) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer (inv_freq aside)
    once, but of the embedding table only the rows it looks up (one a sequence: left out), unless
    the head is that table and reads it whole."""
    model = engine.model
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    total += sum(t.numel() * t.element_size() for n, t in model.named_buffers() if n != "inv_freq")
    table = model.tok_embeddings.weight
    if model.output.weight is not table:
        total -= table.numel() * table.element_size()
    return total


def prefill_params(engine: Engine) -> tuple[int, int]:
    """(per prompt token, per prompt): the weights a prefill multiplies by. Every token goes
    through the layers' projections; only the row it samples goes through the head (engine.py
    selects it first); the embedding table is looked up, not multiplied."""
    model = engine.model
    head, table = model.output.weight, model.tok_embeddings.weight
    total = sum(p.numel() for p in model.parameters())
    layers = total - table.numel() - (0 if head is table else head.numel())
    return layers, head.numel()


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def batch1_decode(engine: Engine, prompt_len: int, steps: int) -> float:
    """Tokens a second of one sequence decoding: one over the median step."""
    times = sorted(batch1_steps(engine, prompt_len, steps))
    return 1 / times[len(times) // 2]


def batch1_steps(engine: Engine, prompt_len: int, steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps of one sequence after a prompt of `prompt_len`."""
    ids = random_prompt(prompt_len, engine.config.vocab_size, 1)
    table = list(range(-(-(prompt_len + steps + 1) // engine.block_size)))
    token = engine.step([SeqInput("b1", ids, 0, table)])[0].token_id
    times = []
    for i in range(steps):
        start = time.perf_counter()
        token = engine.step([SeqInput("b1", [token], prompt_len + i, table)])[0].token_id
        times.append(time.perf_counter() - start)
    engine.release(["b1"])
    return times


def graph_only(engine: Engine, prompt_len: int, steps: int) -> float:
    """Batch-1 decode steps of the captured graph alone: no sampling, no Python around it."""
    graphs = engine.graphs
    if graphs is None:
        return 0.0
    ids = random_prompt(prompt_len, engine.config.vocab_size, 3)
    table = list(range(-(-(prompt_len + steps + 1) // engine.block_size)))
    engine.step([SeqInput("g", ids, 0, table)])
    engine.step([SeqInput("g", [1], prompt_len, table)])  # the bucket's rows hold this step
    engine._ahead = None
    graph, _ = graphs.graphs[1]
    seconds = timed(graph.replay, steps)
    engine.release(["g"])
    return 1 / seconds


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

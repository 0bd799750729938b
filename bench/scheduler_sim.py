"""The scheduler policy under named workloads, on simulated time, plus its real per-step cost.

    .venv/bin/python -m bench.scheduler_sim [--json PATH] [--quick] [--only NAME ...]

Every scenario but `schedule_cost` runs the real `Scheduler` against the simulated worker
(`harness.sim_worker`), whose step time comes from `CostModel` (by default a
LLaMA-3-8B-sized model in bf16 on one H200: 4 ms per decode step, 27 µs per prefill token).
Times in those scenarios are simulated seconds; `schedule_cost` is measured wall-clock time of
`Scheduler.schedule()` and `update()` on this machine, and `overlap` charges the measured time
of those calls (and a hop each way) to the simulated clock. Numbers, not assertions: the tests
prove behaviour.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness.sim_worker import CostModel, SimClock, SimWorker
from harness.simulation import RequestRecord, Simulation
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

BLOCK = 16
# A pool the size an H200 leaves an 8B model (about 70 GiB of KV at 128 KiB per token).
POOL_BLOCKS = 36_000
BASE: dict[str, Any] = {
    "num_kv_blocks": POOL_BLOCKS,
    "block_size": BLOCK,
    "max_model_len": 8192,
    "max_num_seqs": 128,
    # Latency-oriented steps (as Sarathi-Serve recommends for tight TTFT/TBT targets).
    "max_num_batched_tokens": 512,
    "long_prefill_token_threshold": 512,
    "async_scheduling": False,  # the overlap section asks for it by name
}


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def simulate(
    requests: list[tuple[float, Request]],
    cost: CostModel | None = None,
    hop_s: float = 0.0,
    charge_scheduler: bool = False,
    **overrides: Any,
) -> tuple[Simulation, float]:
    """Run the requests (arrival time, request) to completion; returns the simulation and the
    simulated makespan. `hop_s` and `charge_scheduler`: see Simulation."""
    clock = SimClock()
    config = SchedulerConfig(**{**BASE, **overrides})
    sim = Simulation(
        Scheduler(config, clock),
        clock,
        SimWorker(config.num_kv_blocks, config.block_size, check_kv=False),
        cost or CostModel(),
        hop_s=hop_s,
        charge_scheduler=charge_scheduler,
    )
    for at, request in requests:
        sim.submit(request, at=at)
    sim.run()
    return sim, clock.now


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32000) for _ in range(n)]


# Sequence ids of the requests the workloads make, unique within a run.
_seq_ids = itertools.count()


def chat_request(rng: random.Random, priority: int = 0) -> Request:
    return Request(
        next(_seq_ids), tokens(rng, rng.randint(200, 800)), rng.randint(50, 200), priority=priority
    )


def poisson(rng: random.Random, rate: float, duration: float) -> list[float]:
    t, out = 0.0, list[float]()
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def served(
    records: dict[int, RequestRecord], keep: Callable[[Request], bool]
) -> list[RequestRecord]:
    return [r for r in records.values() if keep(r.request) and r.first_token_at is not None]


# -- scenarios -------------------------------------------------------------------------------


def overload_priority(quick: bool) -> dict[str, float]:
    """2× overload, 10% of it high priority: high TTFT against the same requests alone, with
    lower-priority prefill yielding to the high-priority traffic (the default, 192 tokens a
    step) and without (`_yield_off`); the low-priority side's cost of it in throughput and ITL."""
    rng = random.Random(1)
    # Capacity: a saturating batch of the same mix, all at once.
    batch = [(0.0, chat_request(rng)) for i in range(300 if quick else 600)]
    _, makespan = simulate(batch, max_queued_requests=10_000)
    capacity = len(batch) / makespan
    duration = 20.0 if quick else 60.0
    arrivals = poisson(rng, 2 * capacity, duration)
    workload = []
    for _i, at in enumerate(arrivals):
        is_hi = rng.random() < 0.1
        workload.append((at, chat_request(rng, 1 if is_hi else 0)))
    alone, _ = simulate([(at, r) for at, r in workload if r.priority == 1])

    def is_high(r: Request) -> bool:
        return r.priority == 1

    base = [r.ttft or 0.0 for r in served(alone.records, is_high)]
    out: dict[str, float] = {
        "capacity_rps": capacity,
        "offered_rps": len(workload) / duration,
        "idle_high_ttft_p50_s": pct(base, 50),
        "idle_high_ttft_p99_s": pct(base, 99),
    }
    variants: list[tuple[str, dict[str, Any]]] = [
        ("", {}),
        ("_yield_off", {"lower_priority_prefill_tokens": 0}),
    ]
    for suffix, overrides in variants:
        overload, _ = simulate(workload, max_queued_requests=512, **overrides)
        high = [r.ttft or 0.0 for r in served(overload.records, is_high)]
        low = served(overload.records, lambda r: r.priority == 0)
        itl = [gap for r in low for gap in r.inter_token_latencies]
        rejected = sum(1 for r in overload.records.values() if r.rejected)
        out |= {
            f"high_ttft_p50_s{suffix}": pct(high, 50),
            f"high_ttft_p99_s{suffix}": pct(high, 99),
            f"high_ttft_p50_ratio{suffix}": pct(high, 50) / pct(base, 50),
            f"high_ttft_p99_ratio{suffix}": pct(high, 99) / pct(base, 99),
            f"low_max_wait_s{suffix}": max(r.queue_wait or 0.0 for r in low),
            f"low_ttft_p50_s{suffix}": pct([r.ttft or 0.0 for r in low], 50),
            f"low_output_tok_s{suffix}": sum(len(r.tokens) for r in low) / duration,
            f"low_itl_p50_ms{suffix}": pct(itl, 50) * 1e3,
            f"low_itl_p99_ms{suffix}": pct(itl, 99) * 1e3,
            f"rejected_fraction{suffix}": rejected / len(workload),
            f"preemptions{suffix}": overload.scheduler.stats().num_preemptions,
        }
    return out


def shared_prefix(quick: bool) -> dict[str, float]:
    """Chat with 8 shared system prompts of 1,024 tokens and second turns that repeat the first
    turn's prompt; prefix caching on against off, at an offered load caching-off cannot carry."""
    rng = random.Random(2)
    systems = [tokens(rng, 1024) for _ in range(8)]
    duration = 10.0 if quick else 30.0
    workload = []
    for i, at in enumerate(poisson(rng, 40.0, duration)):
        first = [*rng.choice(systems), *tokens(rng, rng.randint(50, 300))]
        session = f"s{i}"
        workload.append(
            (at, Request(next(_seq_ids), first, rng.randint(50, 150), session_id=session))
        )
        if rng.random() < 0.5:
            second = [*first, *tokens(rng, rng.randint(100, 300))]
            workload.append((at + 2.0, Request(next(_seq_ids), second, 100, session_id=session)))
    out: dict[str, float] = {}
    for name, caching in (("on", True), ("off", False)):
        sim, makespan = simulate(
            workload, enable_prefix_caching=caching, max_queued_requests=10_000
        )
        stats = sim.scheduler.stats()
        done = served(sim.records, lambda r: True)
        out[f"hit_rate_{name}"] = stats.prefix_cache_hit_rate
        out[f"throughput_rps_{name}"] = len(done) / makespan
        out[f"output_tok_s_{name}"] = sum(len(r.tokens) for r in done) / makespan
        out[f"ttft_p50_s_{name}"] = pct([r.ttft or 0.0 for r in done], 50)
        out[f"ttft_p99_s_{name}"] = pct([r.ttft or 0.0 for r in done], 99)
    out["throughput_gain"] = out["throughput_rps_on"] / out["throughput_rps_off"]
    return out


def long_prompt(quick: bool) -> dict[str, float]:
    """One 32k-token prompt arrives among short requests: their TTFT with and without chunking."""
    rng = random.Random(3)
    duration = 6.0 if quick else 12.0
    workload = [
        (at, Request(next(_seq_ids), tokens(rng, rng.randint(100, 300)), rng.randint(20, 100)))
        for i, at in enumerate(poisson(rng, 20.0, duration))
    ]
    long = Request(next(_seq_ids), tokens(rng, 32_768), 16)
    workload.append((2.0, long))
    out: dict[str, float] = {}
    common: dict[str, Any] = {"max_model_len": 32_768 + 1024}
    runs: dict[str, dict[str, Any]] = {
        "chunked": {"max_num_batched_tokens": 1024, "long_prefill_token_threshold": 512},
        "unchunked": {"enable_chunked_prefill": False, "max_num_batched_tokens": 32_768 + 1024},
    }
    for name, overrides in runs.items():
        sim, _ = simulate(workload, **common, **overrides)
        short = [r.ttft or 0.0 for r in served(sim.records, lambda r: r is not long)]
        out[f"short_ttft_p50_s_{name}"] = pct(short, 50)
        out[f"short_ttft_p99_s_{name}"] = pct(short, 99)
        out[f"short_ttft_max_s_{name}"] = max(short)
        out[f"long_ttft_s_{name}"] = sim.records[long.seq_id].ttft or float("nan")
    return out


def batch_window(quick: bool) -> dict[str, float]:
    """Bursts of requests within 300 µs, every 40 ms, on a lightly loaded worker: what the
    micro-batch window costs in TTFT and saves in worker time. Bursts of 4 fill the window
    (window_max_seqs=4) and close it early; bursts of 2 make it wait its full length; lone
    requests (bursts of 1) never make it hold, as arrivals are sparse."""
    out: dict[str, float] = {}
    for size in (4, 2, 1):
        rng = random.Random(4)
        workload = []
        for k in range(100 if quick else 300):
            for _j in range(size):
                request = Request(next(_seq_ids), tokens(rng, rng.randint(32, 96)), 8)
                workload.append((k * 0.04 + rng.uniform(0, 0.0003), request))
        for wait_us in (0, 500, 2000):
            sim, _ = simulate(workload, max_wait_us=float(wait_us))
            ttft = [r.ttft or 0.0 for r in served(sim.records, lambda r: True)]
            key = f"burst{size}_w{wait_us}us"
            out[f"ttft_p50_ms_{key}"] = pct(ttft, 50) * 1e3
            out[f"ttft_p99_ms_{key}"] = pct(ttft, 99) * 1e3
            out[f"worker_busy_s_{key}"] = sum(step.duration for step in sim.steps)
    return out


def schedule_cost(quick: bool) -> dict[str, float]:
    """Wall-clock `schedule()` at steady-state decode with 16, 256 and 1,024 running sequences
    (the worker and `update()` run between calls, untimed; `update()` is reported apart)."""
    out: dict[str, float] = {}
    steps = 200 if quick else 600
    for n in (16, 256, 1024):
        clock = SimClock()
        config = SchedulerConfig(
            **{
                **BASE,
                "max_num_seqs": n,
                "max_num_batched_tokens": max(n, 4096),
                "num_kv_blocks": n * 256,
            }
        )
        sched = Scheduler(config, clock)
        worker = SimWorker(config.num_kv_blocks, config.block_size, check_kv=False)
        rng = random.Random(n)
        for _i in range(n):
            sched.add_request(Request(next(_seq_ids), tokens(rng, 512), 3000))
        while sched.stats().num_running < n or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
        ):
            plan = sched.schedule()
            sched.update(plan, worker.execute(plan))
            clock.advance(0.01)
        sched_us, update_us = [], []
        gc.collect()
        for _ in range(steps):
            start = time.perf_counter()
            plan = sched.schedule()
            mid = time.perf_counter()
            result = worker.execute(plan)
            before = time.perf_counter()
            sched.update(plan, result)
            end = time.perf_counter()
            clock.advance(0.01)
            sched_us.append((mid - start) * 1e6)
            update_us.append((end - before) * 1e6)
        out[f"us_at_{n}"] = statistics.median(sched_us)
        out[f"us_p99_at_{n}"] = pct(sched_us, 99)
        out[f"us_min_at_{n}"] = min(sched_us)
        out[f"update_us_at_{n}"] = statistics.median(update_us)
    return out


# A model small enough that a decode step is ~1 ms (SmolLM2-135M-sized on one GPU, CUDA graphs):
# there the scheduler's own time and the hop are a large share of each step.
SMALL_MODEL = CostModel(fixed_s=0.3e-3, weights_s=0.7e-3, per_token_s=1e-6, per_seq_s=1e-6)
HOP_S = 50e-6


def overlap(quick: bool) -> dict[str, float]:
    """A saturating chat batch with and without async scheduling, on a loop that pays what the
    real service pays: a 50 µs hop each way per step and the scheduler's own measured wall
    time in schedule() and update() (during which it does nothing else). Without overlap the
    worker sits out all of it every step; with it, only what does not fit behind a step."""
    out: dict[str, float] = {}
    for model, cost in (("8b", CostModel()), ("small", SMALL_MODEL)):
        rng = random.Random(5)
        batch = [(0.0, chat_request(rng)) for i in range(200 if quick else 600)]
        for mode, overlap_on in (("sync", False), ("async", True)):
            sim, makespan = simulate(
                batch,
                cost,
                hop_s=HOP_S,
                charge_scheduler=True,
                async_scheduling=overlap_on,
                max_queued_requests=10_000,
            )
            done = served(sim.records, lambda r: True)
            itl = [gap for r in done for gap in r.inter_token_latencies]
            busy = sum(step.duration for step in sim.steps)
            key = f"{mode}_{model}"
            out[f"output_tok_s_{key}"] = sum(len(r.tokens) for r in done) / makespan
            out[f"itl_p50_ms_{key}"] = pct(itl, 50) * 1e3
            out[f"itl_p99_ms_{key}"] = pct(itl, 99) * 1e3
            out[f"ttft_p50_s_{key}"] = pct([r.ttft or 0.0 for r in done], 50)
            out[f"worker_idle_fraction_{key}"] = 1 - busy / makespan
            out[f"scheduler_us_per_step_{key}"] = sim.scheduler_s / len(sim.steps) * 1e6
        out[f"throughput_gain_{model}"] = (
            out[f"output_tok_s_async_{model}"] / out[f"output_tok_s_sync_{model}"]
        )
    return out


SCENARIOS: dict[str, Callable[[bool], dict[str, float]]] = {
    "overload_priority": overload_priority,
    "shared_prefix": shared_prefix,
    "long_prompt": long_prompt,
    "batch_window": batch_window,
    "schedule_cost": schedule_cost,
    "overlap": overlap,
}


def table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| scenario | metric | value |", "|---|---|---|"]
    for name, metrics in results.items():
        for key, value in metrics.items():
            lines.append(f"| {name} | {key} | {value:.4g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write {'scenarios': {name: metrics}} here")
    parser.add_argument("--quick", action="store_true", help="shorter runs (about a third)")
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), help="run just these")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    for name, run in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        results[name] = run(args.quick)
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
    print(table(results))
    if args.json:
        payload = {
            "scenarios": results,
            "cost_model": dataclasses.asdict(CostModel()),
            "quick": args.quick,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

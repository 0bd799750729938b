"""Garbage written into the pipeline's rings and its prompt arena by a rogue process of the same
user (harness/rogue.py), beside a 4-stream load, one scenario after another on one pipeline.

So that each write lands where it is meant to, the processes at both ends of the segment are
stopped (SIGSTOP) for the instant of the write and continued (SIGCONT) right after, the reader
first: a ring's producer and consumer; for the arena, the worker (a victim request is submitted
while it is stopped, so the worker reads the victim's prompt only after the rogue wrote over it).

What each scenario may cost, as far as the design allows: a ring carries every step (or every
event) of one link, so a corrupt ring ends that link: the requests in flight on it fail with a
status naming the lost link, the link is attached afresh, and the requests after it succeed.
A region of the arena belongs to one request: only that request may fail. The arena's headers
belong to every request of that tokenizer. No process may exit, nothing may hang, and no KV
block or arena byte may stay held once the load drains.
"""

from __future__ import annotations

import asyncio
import random
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.faults import calls, workload
from bench.faults.campaign import Campaign, after_drain, arena_bytes_in_use, close
from bench.faults.kills import PROBE
from bench.faults.load import Load
from bench.faults.outcome import Outcome, Tally
from bench.faults.served import Served, drained, leaked_blocks, serve, stats
from harness import rogue
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

STREAMS = 4
AFTER_S = 3.0  # load kept running after the write, before the probe
RECOVERY_BOUND_S = 60.0
VICTIM_SUBMIT_BOUND_S = 30.0
SCENARIOS = (  # (segment, mode)
    ("step", "ring-garbage"),
    ("step", "ring-forge"),
    ("result", "ring-garbage"),
    ("result", "ring-forge"),
    ("events", "ring-garbage"),
    ("events", "ring-forge"),
    ("arena", "arena-data"),
    ("arena", "arena-gen"),
    ("arena", "arena-table"),
    ("arena", "arena-header"),
)


@dataclass(frozen=True)
class RogueConfig:
    repeats: int  # times each scenario runs
    seed: int


def _segment(served: Served, which: str) -> tuple[str, int | None, list[int]]:
    """The segment's name, the pid that writes it and the pids that read it."""
    pid = {name: served.pipe.latest(name).pid for name in ("scheduler", "worker", "tokenizer-1")}
    if which == "arena":
        return rogue.segments(pid["tokenizer-1"], "arena")[0], None, [pid["worker"]]
    if which == "result":
        return rogue.segments(pid["worker"], "ring")[0], pid["worker"], [pid["scheduler"]]
    rings = rogue.segments(pid["scheduler"], "ring")  # the step ring is twice an event ring
    if which == "step":
        return rings[-1], pid["scheduler"], [pid["worker"]]
    return rings[0], pid["scheduler"], [pid["tokenizer-1"]]


async def _probe(address: str, tally: Tally) -> float | None:
    """Seconds until a one-token request succeeds (None: not within the bound)."""
    start = time.monotonic()
    async with calls.channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while time.monotonic() - start < RECOVERY_BOUND_S:
            if tally.add(await calls.generate(stub, PROBE)).kind == "ok":
                return round(time.monotonic() - start, 2)
            await asyncio.sleep(0.1)
    return None


async def _victim(served: Served, n: int, tally: Tally) -> tuple[asyncio.Task[Outcome], bytes]:
    """A request submitted while the worker is stopped, and its prompt's int32 ids (the rogue
    finds its region by them)."""
    text = f"Victim {n}: zebra quartz {n * 7919} lantern " + workload.words(random.Random(n), 30)
    async with calls.channel(served.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        ids = (await stub.Tokenize(pb.TokenizeRequest(text=text), timeout=30)).token_ids
    request = pb.GenerateRequest(text=text, max_tokens=8, ignore_eos=True)
    submitted = asyncio.Event()

    def on_reply(_: int) -> None:
        submitted.set()  # the first reply comes once the scheduler has the request

    async def run() -> Outcome:
        async with calls.channel(served.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return tally.add(await calls.generate(stub, request, on_reply=on_reply))

    task = asyncio.create_task(run())
    async with asyncio.timeout(VICTIM_SUBMIT_BOUND_S):
        await submitted.wait()
    return task, struct.pack(f"<{len(ids)}i", *ids)


async def _scenario(
    served: Served, which: str, mode: str, seed: int, result: Campaign
) -> dict[str, Any]:
    load_tally, victim_tally, probes = Tally(), Tally(), Tally()
    load = Load(served.address, STREAMS, lambda r: workload.short(r, 48), seed, load_tally)
    load.start()
    await load.steady(120)
    before = await stats(served.pipe.scheduler_address)
    crashes_before = len(served.crashes())
    victim = None
    wrote = ""
    name, writer, readers = _segment(served, which)
    rogue.stop([*readers, *([writer] if writer is not None else [])])
    try:
        needle = b""
        if mode in ("arena-data", "arena-gen"):
            victim, needle = await _victim(served, seed, victim_tally)
        wrote = await asyncio.to_thread(rogue.scribble, mode, name, seed, needle)
    except TimeoutError:
        wrote = f"the victim was not submitted within {VICTIM_SUBMIT_BOUND_S:.0f} s"
    finally:
        await asyncio.to_thread(rogue.resume, writer, readers)
    await asyncio.sleep(AFTER_S)
    recovered = await _probe(served.address, probes)
    await load.stop()
    if victim is not None:
        await victim
    drained_stats = await drained(served)
    after = await stats(served.pipe.scheduler_address)
    for tally in (load_tally, victim_tally, probes):
        result.tally.merge(tally)
    return {
        "segment": which,
        "mode": mode,
        "wrote": wrote,
        "victim": dict(victim_tally.codes) | {"details": list(victim_tally.examples.values())},
        "load_statuses": dict(load_tally.codes),
        "load_error_examples": load_tally.examples,
        "probe_recovery_s": recovered,
        "link_reattached": after.worker_restarts - before.worker_restarts,
        "kv_blocks_held_after": leaked_blocks(drained_stats),
        "arena_bytes_held_after": arena_bytes_in_use(served),
        "process_exits": len(served.crashes()) - crashes_before,
    }


async def _rogue_campaign(served: Served, cfg: RogueConfig, result: Campaign) -> None:
    rng = random.Random(cfg.seed)
    runs = []
    for _ in range(cfg.repeats):
        for which, mode in SCENARIOS:
            runs.append(await _scenario(served, which, mode, rng.getrandbits(31), result))
    await after_drain(served, result)
    result.extra["scenarios"] = runs


def run(log_dir: Path, cfg: RogueConfig) -> Campaign:
    result = Campaign("rogue_shm")
    started = time.monotonic()
    with serve(log_dir / "rogue", "--max-num-seqs", str(STREAMS + 2)) as served:
        asyncio.run(_rogue_campaign(served, cfg, result))
    result.wall_s = time.monotonic() - started
    return close(served, result)

"""Client cancellations at random points of a request's life, beside witnesses that must not
notice: before the first message (tokenizing, submitting), before the first token (queued or
in prefill: prompts of tens to a few hundred tokens), and after k tokens (decode).

Where a cancellation landed is what the client saw when it cancelled (`cancelled_at`); the
scheduler's `finished["cancelled"]` and its KV accounts after the drain say whether the server
let go of what each held.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.faults import calls, workload
from bench.faults.campaign import Campaign, after_drain, close
from bench.faults.load import Load
from bench.faults.outcome import Tally
from bench.faults.served import Served, serve
from tandem.v1 import generation_pb2_grpc

CONCURRENT = 8
WITNESSES = 2
# Up to this long after the first message, a prompt of this campaign is still in prefill on
# this machine (most of the time: where it landed is recorded, not assumed).
PREFILL_WINDOW_S = 0.3


@dataclass(frozen=True)
class CancelConfig:
    cancellations: int
    seed: int


def _point(rng: random.Random) -> calls.CancelAt:
    phase = rng.choices(("submit", "prefill", "decode"), weights=(1, 4, 4))[0]
    if phase == "submit":
        return calls.CancelAt("submit", delay_s=rng.uniform(0, 0.01))
    if phase == "prefill":
        return calls.CancelAt("prefill", delay_s=rng.uniform(0, PREFILL_WINDOW_S))
    return calls.CancelAt("decode", after_tokens=rng.randint(1, 16))


async def _cancels(served: Served, cfg: CancelConfig, result: Campaign) -> None:
    rng = random.Random(cfg.seed)
    witness_tally, cancel_tally = Tally(), Tally()
    witnesses = Load(
        served.address, WITNESSES, lambda r: workload.short(r, 24), cfg.seed, witness_tally
    )
    witnesses.start()
    landed: Counter[str] = Counter()
    asked: Counter[str] = Counter()
    jobs = [
        (workload.long_prompt(rng, rng.randint(20, 250), 24), _point(rng))
        for _ in range(cfg.cancellations)
    ]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(jobs)):
        queue.put_nowait(i)

    async def runner() -> None:
        async with calls.channel(served.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while not queue.empty():
                request, point = jobs[queue.get_nowait()]
                outcome = cancel_tally.add(await calls.generate(stub, request, point))
                asked[point.phase] += 1
                landed[outcome.cancelled_at or f"not cancelled ({outcome.code})"] += 1

    await asyncio.gather(*(runner() for _ in range(CONCURRENT)))
    await witnesses.stop()
    await after_drain(served, result)
    result.tally.merge(cancel_tally)
    result.tally.merge(witness_tally)
    result.extra.update(
        cancel_requests=cancel_tally.requests,
        cancel_statuses=dict(cancel_tally.codes),
        asked_phase=dict(asked),
        landed_phase=dict(landed),
        witness_requests=witness_tally.requests,
        witness_statuses=dict(witness_tally.codes),
    )


def run(log_dir: Path, cfg: CancelConfig) -> Campaign:
    result = Campaign("cancellations")
    started = time.monotonic()
    with serve(log_dir / "cancels") as served:
        asyncio.run(_cancels(served, cfg, result))
    result.wall_s = time.monotonic() - started
    return close(served, result)

"""N fuzzed requests to every public RPC (fuzzing.py makes them), CONCURRENT at a time, each of
which must end with a status: OK, or an error whose details name the problem. A Generate the
server accepts is cancelled by the client after its first tokens (it was answered; running it to
a fuzzed max_tokens would only measure the CPU), so sampling values reach the worker's sampler.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.faults import calls, fuzzing
from bench.faults.campaign import Campaign, after_drain, close
from bench.faults.outcome import Tally
from bench.faults.served import Served, serve
from tandem.v1 import generation_pb2 as pb

CONCURRENT = 8
METHODS = {
    "Generate": "/tandem.v1.Generation/Generate",
    "Tokenize": "/tandem.v1.Generation/Tokenize",
    "Detokenize": "/tandem.v1.Generation/Detokenize",
    "ListModels": "/tandem.v1.Generation/ListModels",
    "Health.Check": "/grpc.health.v1.Health/Check",
}


@dataclass(frozen=True)
class FuzzConfig:
    per_rpc: int
    seed: int


def _identity(data: bytes) -> bytes:
    return data


async def _fuzz(served: Served, cfg: FuzzConfig, result: Campaign) -> None:
    rng = random.Random(cfg.seed)
    jobs = [(rpc, i) for rpc in METHODS for i in range(cfg.per_rpc)]
    rng.shuffle(jobs)
    seeds = [rng.getrandbits(64) for _ in jobs]
    by_rpc = {rpc: Tally() for rpc in METHODS}
    slowest: Counter[str] = Counter()
    seconds: Counter[str] = Counter()
    wire_cases: Counter[str] = Counter()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for k in range(len(jobs)):
        queue.put_nowait(k)

    async def runner() -> None:
        async with calls.channel(served.address) as channel:
            methods = {
                rpc: (
                    channel.unary_stream(path, _identity, pb.GenerateResponse.FromString)
                    if rpc == "Generate"
                    else channel.unary_unary(path, _identity, _identity)
                )
                for rpc, path in METHODS.items()
            }
            while not queue.empty():
                k = queue.get_nowait()
                rpc = jobs[k][0]
                case_rng = random.Random(seeds[k])
                data, how = fuzzing.payload(case_rng, rpc)
                wire_cases[how] += 1
                started = time.monotonic()
                if rpc == "Generate":
                    cancel = calls.CancelAt("decode", after_tokens=case_rng.randint(1, 4))
                    outcome = await calls.generate(methods[rpc], data, cancel)
                else:
                    outcome = await calls.unary(methods[rpc], data)
                took = time.monotonic() - started
                slowest[rpc] = max(slowest[rpc], round(took, 2))  # type: ignore[assignment]
                seconds[rpc] += took  # type: ignore[assignment]
                by_rpc[rpc].add(outcome)

    await asyncio.gather(*(runner() for _ in range(CONCURRENT)))
    await after_drain(served, result)
    for tally in by_rpc.values():
        result.tally.merge(tally)
    result.extra.update(
        per_rpc=cfg.per_rpc,
        wire_level_cases=wire_cases["wire"],
        by_rpc={
            rpc: {"requests": t.requests, "kinds": dict(t.kinds), "statuses": dict(t.codes)}
            for rpc, t in by_rpc.items()
        },
        slowest_call_s=dict(slowest),
        seconds_in_calls={rpc: round(s, 1) for rpc, s in seconds.items()},
    )


def run(log_dir: Path, cfg: FuzzConfig) -> Campaign:
    result = Campaign("fuzz")
    started = time.monotonic()
    with serve(log_dir / "fuzz") as served:
        asyncio.run(_fuzz(served, cfg, result))
    result.wall_s = time.monotonic() - started
    return close(served, result)

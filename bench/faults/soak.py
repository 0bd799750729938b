"""The soak: N requests at a fixed arrival rate (open loop), mixed priorities, lengths, stop
strings, sampling and client cancellations; each process's memory after every thousand
requests; TTFT p99 of the first and the last thousand."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

from bench.faults import calls, workload
from bench.faults.campaign import Campaign, after_drain, close
from bench.faults.outcome import Outcome
from bench.faults.served import Served, serve
from tandem.v1 import generation_pb2_grpc

CHANNELS = 4
CANCEL_SHARE = 0.05


@dataclass(frozen=True)
class SoakConfig:
    requests: int
    rate: float  # arrivals per second
    seed: int
    window: int = 1000  # requests per memory sample, and per TTFT window (first and last)


def _cancel(rng: random.Random) -> calls.CancelAt | None:
    if rng.random() >= CANCEL_SHARE:
        return None
    phase = rng.choice(("submit", "prefill", "decode"))
    return calls.CancelAt(phase, delay_s=rng.uniform(0, 0.05), after_tokens=rng.randint(1, 8))


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)


async def _soak(served: Served, cfg: SoakConfig, result: Campaign) -> None:
    rng = random.Random(cfg.seed)
    names = served.process_names()
    per = min(cfg.window, cfg.requests)
    memory: dict[str, list[float]] = {name: [served.rss_mib(name)] for name in names}
    outcomes: list[Outcome | None] = [None] * cfg.requests
    done = 0
    channels = [calls.channel(served.address) for _ in range(CHANNELS)]
    stubs = [generation_pb2_grpc.GenerationStub(ch) for ch in channels]

    async def one(i: int) -> None:
        nonlocal done
        request, cancel = workload.mixed(rng), _cancel(rng)
        outcome = await calls.generate(stubs[i % CHANNELS], request, cancel)
        outcomes[i] = result.tally.add(outcome)
        done += 1
        if done % per == 0:
            for name in names:
                memory[name].append(served.rss_mib(name))

    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    lag = 0.0
    for i in range(cfg.requests):
        due = start + i / cfg.rate
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            lag = max(lag, -delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    elapsed = loop.time() - start
    for ch in channels:
        await ch.close()
    await after_drain(served, result)

    def ttfts(part: list[Outcome | None]) -> list[float]:
        return [o.ttft_s for o in part if o is not None and o.ttft_s is not None]

    growth = {}
    for name, samples in memory.items():
        # The first thousand warms up (caches, allocator pools): growth is measured after it.
        later = samples[1:] if len(samples) > 2 else samples
        thousands = max(1, len(later) - 1) * per / 1000
        growth[name] = round((later[-1] - later[0]) / thousands, 2)
    result.extra.update(
        rate_per_s=cfg.rate,
        achieved_rate_per_s=round(cfg.requests / elapsed, 2),
        max_arrival_lag_s=round(lag, 3),
        window=per,
        rss_mib_every_window={n: [round(v, 1) for v in s] for n, s in memory.items()},
        rss_growth_mib_per_thousand=growth,
        ttft_p99_first_window_s=_p99(ttfts(outcomes[:per])),
        ttft_p99_last_window_s=_p99(ttfts(outcomes[-per:])),
        cancelled_by_client=sum(1 for o in outcomes if o is not None and o.code == "CANCELLED"),
    )


def run(log_dir: Path, cfg: SoakConfig) -> Campaign:
    result = Campaign("soak")
    started = time.monotonic()
    with serve(log_dir / "soak") as served:
        asyncio.run(_soak(served, cfg, result))
    result.wall_s = time.monotonic() - started
    return close(served, result)

"""Sends a workload to each target in turn and records every request.

A target's run is a warm-up phase (its records kept, marked, left out of the figures), then the
measured phase: requests start as soon as a slot is free (fixed concurrency) or at Poisson
arrival times (--rate, optionally capped), until the count is sent or --duration has passed;
requests still in flight then finish and count. The measured window runs from the phase's first
send to its last request's end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, aclosing
from dataclasses import dataclass
from itertools import islice

from tqdm import tqdm

from services.bench.backends import Backend, open_backend
from services.bench.config import BenchConfig, Target
from services.bench.record import RequestFailed, RequestRecord
from services.bench.workload import RequestSpec, arrival_gaps, requests

Clock = Callable[[], float]
BackendFactory = Callable[[Target, BenchConfig], AbstractAsyncContextManager[Backend]]


@dataclass
class TargetRun:
    target: Target
    records: list[RequestRecord]  # warm-up first, then measured, each in order of sending
    window: tuple[float, float]  # the measured phase, seconds since the run began

    @property
    def measured(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.warmup]


async def run(
    config: BenchConfig, open_: BackendFactory = open_backend, clock: Clock = time.perf_counter
) -> list[TargetRun]:
    # One target after the other: on a shared machine, servers measured at once would slow
    # each other down.
    return [await run_target(t, config, open_, clock) for t in config.targets]


async def run_target(
    target: Target, config: BenchConfig, open_: BackendFactory, clock: Clock
) -> TargetRun:
    specs = requests(config)
    async with open_(target, config) as backend:
        phase = _Phase(backend, config, clock, clock())
        warmup = list(islice(specs, config.warmup))
        if warmup:
            cap = min(config.in_flight_cap or len(warmup), len(warmup))
            with _bar(config, f"{target.label} warm-up", len(warmup)) as bar:
                await phase.send(iter(warmup), cap, None, None, bar, warmup=True)
        count = config.measured_requests
        measured = specs if count is None else islice(specs, count)
        start = clock() - phase.t0
        with _bar(config, target.label, count) as bar:
            await phase.send(
                measured,
                config.in_flight_cap,
                config.rate,
                config.duration,
                bar,
                warmup=False,
            )
        records = phase.records
    ends = [r.finished_at for r in records if not r.warmup and r.finished_at is not None]
    return TargetRun(target, records, (start, max(ends, default=start)))


def _bar(config: BenchConfig, label: str, total: int | None) -> tqdm:
    return tqdm(total=total, desc=label, unit="req", disable=not config.progress, leave=True)


class _Phase:
    def __init__(self, backend: Backend, config: BenchConfig, clock: Clock, t0: float) -> None:
        self.backend = backend
        self.config = config
        self.clock = clock
        self.t0 = t0
        self.records: list[RequestRecord] = []

    async def send(
        self,
        specs: Iterator[RequestSpec],
        cap: int | None,
        rate: float | None,
        duration: float | None,
        bar: tqdm,
        *,
        warmup: bool,
    ) -> None:
        slots = asyncio.Semaphore(cap) if cap is not None else None
        gaps = arrival_gaps(rate, self.config.seed) if rate is not None else None
        began = self.clock()
        next_at = began
        failed = 0

        def done(record: RequestRecord) -> None:
            nonlocal failed
            failed += not record.ok
            bar.update(1)
            bar.set_postfix(failed=failed, refresh=False)

        async with asyncio.TaskGroup() as group:
            for spec in specs:
                if gaps is not None:
                    next_at += next(gaps)
                    # Poisson arrivals within the duration are a fixed set, drawn from the seed.
                    if duration is not None and next_at - began >= duration:
                        break
                    await asyncio.sleep(max(0.0, next_at - self.clock()))
                if slots is not None:
                    await slots.acquire()
                if gaps is None and duration is not None and self.clock() - began >= duration:
                    if slots is not None:
                        slots.release()
                    break
                group.create_task(self._one(spec, warmup, slots, done))

    async def _one(
        self,
        spec: RequestSpec,
        warmup: bool,
        slots: asyncio.Semaphore | None,
        done: Callable[[RequestRecord], None],
    ) -> None:
        sent = self.clock()
        record = RequestRecord(spec.index, spec.priority, warmup, sent - self.t0)
        self.records.append(record)
        try:
            async with asyncio.timeout(self.config.timeout):
                async with aclosing(self.backend.stream(spec)) as events:
                    async for event in events:
                        record.observe(event, self.clock() - sent)
            record.end = self.clock() - sent
        except RequestFailed as err:
            record.fail(err, self.clock() - sent)
        except TimeoutError:
            record.fail(
                RequestFailed("TIMEOUT", f"no end within --timeout {self.config.timeout:g} s"),
                self.clock() - sent,
            )
        except Exception as err:
            # A client-side bug fails one request, shown with its type, not the whole run.
            record.fail(
                RequestFailed("CLIENT_ERROR", f"{type(err).__name__}: {err}"), self.clock() - sent
            )
        finally:
            if slots is not None:
                slots.release()
            done(record)

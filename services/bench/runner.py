"""Sends a workload to each target in turn and records every request.

A target's run is a warm-up phase (its records kept, marked, left out of the figures), then the
measured phase: requests start as soon as a slot is free (fixed concurrency) or at Poisson
arrival times (--rate, optionally capped), until the count is sent or --duration has passed;
requests still in flight then finish and count. The measured window runs from the phase's first
send to its last request's end.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from itertools import islice

from tqdm import tqdm

from services.bench.backends import Backend, open_backend
from services.bench.config import BenchConfig, Target
from services.bench.record import RequestFailed, RequestRecord
from services.bench.workload import RequestSpec, arrival_gaps, requests


@dataclass
class TargetRun:
    target: Target
    records: list[RequestRecord]  # warm-up first, then measured, each in order of sending
    window: tuple[float, float]  # the measured phase, seconds since the run began

    @property
    def measured(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.warmup]


async def run(config: BenchConfig) -> list[TargetRun]:
    # One target after the other: on a shared machine, servers measured at once would slow
    # each other down.
    return [await run_target(t, config) for t in config.targets]


async def run_target(target: Target, config: BenchConfig) -> TargetRun:
    specs = requests(config)
    async with open_backend(target, config) as backend:
        sender = _Sender(backend, config)
        warmup = list(islice(specs, config.warmup))
        if warmup:
            cap = min(config.in_flight_cap or len(warmup), len(warmup))
            label = f"{target.label} warm-up"
            await sender.send(iter(warmup), label, len(warmup), cap, warmup=True)
        count = config.measured_requests
        measured = specs if count is None else islice(specs, count)
        start = time.perf_counter() - sender.t0
        await sender.send(
            measured, target.label, count, config.in_flight_cap, config.rate, config.duration
        )
    records = sender.records
    ends = [r.finished_at for r in records if not r.warmup and r.finished_at is not None]
    return TargetRun(target, records, (start, max(ends, default=start)))


@dataclass
class _Sender:
    backend: Backend
    config: BenchConfig
    t0: float = field(default_factory=time.perf_counter)
    records: list[RequestRecord] = field(default_factory=list)

    async def send(
        self,
        specs: Iterator[RequestSpec],
        label: str,
        total: int | None,
        cap: int | None,
        rate: float | None = None,
        duration: float | None = None,
        *,
        warmup: bool = False,
    ) -> None:
        slots = asyncio.Semaphore(cap) if cap is not None else None
        gaps = arrival_gaps(rate, self.config.seed) if rate is not None else None
        next_at = time.perf_counter()
        stop_at = math.inf if duration is None else next_at + duration
        failed = 0
        bar = tqdm(total=total, desc=label, unit="req", disable=not self.config.progress)

        def done(record: RequestRecord) -> None:
            nonlocal failed
            failed += not record.ok
            bar.update(1)
            bar.set_postfix(failed=failed, refresh=False)

        with bar:
            async with asyncio.TaskGroup() as group:
                for spec in specs:
                    if gaps is not None:
                        next_at += next(gaps)
                        # Poisson arrivals within the duration are a fixed set, drawn from the seed.
                        if next_at >= stop_at:
                            break
                        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                    if slots is not None:
                        await slots.acquire()
                    if gaps is None and time.perf_counter() >= stop_at:
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
        sent = time.perf_counter()
        record = RequestRecord(spec.index, spec.priority, warmup, sent - self.t0)
        self.records.append(record)
        try:
            async with asyncio.timeout(self.config.timeout):
                async with aclosing(self.backend.stream(spec)) as events:
                    async for event in events:
                        record.observe(event, time.perf_counter() - sent)
            record.end = time.perf_counter() - sent
        except Exception as err:
            record.fail(_failure(err, self.config.timeout), time.perf_counter() - sent)
        finally:
            if slots is not None:
                slots.release()
            done(record)


def _failure(err: Exception, timeout: float | None) -> RequestFailed:
    if isinstance(err, RequestFailed):
        return err
    if isinstance(err, TimeoutError):
        return RequestFailed("TIMEOUT", f"no end within --timeout {timeout:g} s")
    # A client-side bug fails one request, shown with its type, not the whole run.
    return RequestFailed("CLIENT_ERROR", f"{type(err).__name__}: {err}")

"""SIGKILLs of every process kind under a 16-stream load, in rounds (worker, scheduler, one
tokenizer of two), each once the load is steady again.

Recovery time: from the SIGKILL to the first probe (a one-token request, started after the
kill, retried every PROBE_EVERY_S) that succeeds through the public address; for a tokenizer,
through the restarted tokenizer's own address (the public port is served by the other one all
along, which `public_outage_s` shows).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

from bench.faults import calls, workload
from bench.faults.campaign import Campaign, after_drain, close
from bench.faults.load import Load
from bench.faults.outcome import Tally
from bench.faults.served import Served, serve
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

STREAMS = 16
KINDS = ("worker", "scheduler", "tokenizer")
PROBE_EVERY_S = 0.1
RECOVERY_BOUND_S = 180.0
STEADY_BOUND_S = 120.0
PROBE = pb.GenerateRequest(text="Ping", max_tokens=1, sampling=pb.SamplingParams(temperature=0))


@dataclass(frozen=True)
class KillConfig:
    rounds: int  # SIGKILLs of each kind
    seed: int


def _load_request(rng: random.Random) -> pb.GenerateRequest:
    return workload.short(rng, max_tokens=rng.randint(16, 96))


async def _probe_until_ok(address: str, probes: Tally, bound_s: float) -> bool:
    """Probe `address` until one request succeeds; False if none does within the bound."""
    deadline = time.monotonic() + bound_s
    async with calls.channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            outcome = probes.add(await calls.generate(stub, PROBE))
            if outcome.kind == "ok":
                return True
            await asyncio.sleep(PROBE_EVERY_S)
    return False


async def _restarted(served: Served, name: str, old_pid: int, bound_s: float) -> str | None:
    """The address of the process that replaced `old_pid` under `name`, once it started."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        latest = served.pipe.latest(name)
        if latest.pid != old_pid:
            return latest.address
        await asyncio.sleep(PROBE_EVERY_S)
    return None


async def _kill_once(served: Served, kind: str, n: int, probes: Tally) -> dict[str, float | None]:
    name = f"tokenizer-{n % 2 + 1}" if kind == "tokenizer" else kind
    start = time.monotonic()
    pid = served.kill(name)
    public_ok = await _probe_until_ok(served.address, probes, RECOVERY_BOUND_S)
    public_s = time.monotonic() - start if public_ok else None
    if kind != "tokenizer":
        return {"recovery_s": public_s, "public_outage_s": public_s}
    own = await _restarted(served, name, pid, RECOVERY_BOUND_S)
    ok = own is not None and await _probe_until_ok(
        own, probes, RECOVERY_BOUND_S - (time.monotonic() - start)
    )
    return {"recovery_s": time.monotonic() - start if ok else None, "public_outage_s": public_s}


def _percentiles(values: list[float | None]) -> dict[str, float | None]:
    got = sorted(v for v in values if v is not None)
    if not got:
        return {"p50": None, "p99": None, "max": None, "unrecovered": len(values)}
    return {
        "p50": round(got[len(got) // 2], 2),
        "p99": round(got[min(len(got) - 1, int(0.99 * len(got)))], 2),
        "max": round(got[-1], 2),
        "unrecovered": len(values) - len(got),
    }


async def _kills(served: Served, cfg: KillConfig, result: Campaign) -> None:
    rng = random.Random(cfg.seed)
    load_tally, probes = Tally(), Tally()
    load = Load(served.address, STREAMS, _load_request, cfg.seed, load_tally)
    load.start()
    times: dict[str, list[dict[str, float | None]]] = {kind: [] for kind in KINDS}
    unsteady = 0
    for n in range(cfg.rounds):
        for kind in KINDS:
            if not await load.steady(STEADY_BOUND_S):
                unsteady += 1
            await asyncio.sleep(rng.uniform(0, 0.5))
            times[kind].append(await _kill_once(served, kind, n, probes))
            dead = served.dead_shm()
            if dead:
                result.notes.append(f"after {kind} kill {n + 1}: dead segments {dead}")
    await load.stop()
    await after_drain(served, result)
    result.tally.merge(load_tally)
    result.tally.merge(probes)
    result.extra.update(
        streams=STREAMS,
        kills_per_kind=cfg.rounds,
        load_requests=load_tally.requests,
        load_statuses=dict(load_tally.codes),
        probe_requests=probes.requests,
        kills_without_steady_load=unsteady,
        recovery_s={k: _percentiles([t["recovery_s"] for t in v]) for k, v in times.items()},
        public_outage_s={
            k: _percentiles([t["public_outage_s"] for t in v]) for k, v in times.items()
        },
        recovery_each_s={
            k: [None if t["recovery_s"] is None else round(t["recovery_s"], 2) for t in v]
            for k, v in times.items()
        },
    )


def run(log_dir: Path, cfg: KillConfig) -> Campaign:
    result = Campaign("sigkill")
    started = time.monotonic()
    flags = ("--tokenizers", "2", "--max-num-seqs", str(STREAMS))
    with serve(log_dir / "kills", *flags) as served:
        asyncio.run(_kills(served, cfg, result))
    result.wall_s = time.monotonic() - started
    return close(served, result)

"""Whole serving workloads in process: the scheduler's policy and the engine in one loop, timed
against the workload's floor, with where each step's time goes.

The floor is the time the hardware needs for the work: every prompt's prefill FLOPs at the
measured matmul rate (each token through the layers, the last one through the head too), plus
every decode step's bytes (the weights it reads once, each sequence's KV at its length) at the
measured copy bandwidth. A workload of n prompts of L tokens and `out` tokens each
has out - 1 decode steps (the first token comes from the prefill).

`StepProfile` times each step's phases on the host (schedule, inputs, the engine's checks and
metadata, its wait and outputs, the scheduler's update) and the GPU's busy span (CUDA events from
the first launch to the last), so that idle = wall - busy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch

import engine.engine as engine_module
from engine.batch import SeqInput
from engine.config import ModelConfig
from engine.engine import Engine
from engine.sampling_params import GREEDY
from services.protocol import StepResult
from services.scheduler.config import SchedulerConfig
from services.scheduler.events import Token
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler


def workload_floor(
    config: ModelConfig,
    params: tuple[int, int],
    weight_bytes: int,
    prompt_lens: list[int],
    out_len: int,
    flops: float,
    bandwidth: float,
    kv_bytes_per_element: int = 2,
) -> float:
    """Seconds the work of the workload needs at the measured rates (see the module's doc).
    params: bench.gpu_measure.prefill_params, the weights per prompt token and per prompt."""
    c = config
    per_token, per_prompt = params
    prefill = sum(
        2 * per_token * n + 2 * per_prompt + 2 * c.n_layers * c.q_dim * n * (n + 1)
        for n in prompt_lens
    )
    kv_token = 2 * c.n_layers * c.kv_dim * kv_bytes_per_element
    steps = out_len - 1
    kv = sum(steps * n + steps * (steps + 1) // 2 for n in prompt_lens) * kv_token
    return prefill / flops + (steps * weight_bytes + kv) / bandwidth


@dataclass
class StepRecord:
    rows: int
    prefill_tokens: int
    wall: float  # seconds, loop top to loop top
    schedule: float = 0.0
    inputs: float = 0.0  # the plan's rows as SeqInputs
    prepare: float = 0.0  # the engine before its first launch: checks, metadata, graph inputs
    sample: float = 0.0  # launching the sampler (eager steps and non-greedy rows)
    outputs: float = 0.0  # waiting for the GPU, the copy back and the outputs
    update: float = 0.0
    busy: float = 0.0  # GPU time from the first launch to the last (CUDA events)


@dataclass
class WorkloadRun:
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    steps: list[StepRecord] = field(default_factory=list)
    compiles: list[str] = field(default_factory=list)  # Triton kernels compiled while it ran


class StepProfile:
    """Times phases of engine steps by wrapping the engine's methods (for benchmarks only)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cuda = engine.device.type == "cuda"  # else no GPU times
        self.current: dict[str, float] = {}
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._first: torch.cuda.Event | None = None
        self._last: torch.cuda.Event | None = None

    def _timed(self, name: str, fn: Callable[..., Any], launches: bool) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - start
            if launches and self.cuda and self._first is None:  # kernels follow at once
                self._first = torch.cuda.Event(enable_timing=True)
                self._first.record()
            return out

        return wrapper

    def _outputs(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        timed = self._timed("outputs", fn, False)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                self._last = torch.cuda.Event(enable_timing=True)
                self._last.record()  # every kernel of the step is queued before it
            return timed(*args, **kwargs)

        return wrapper

    @contextmanager
    def active(self) -> Iterator[StepProfile]:
        e = self.engine
        saved = (e.collect, e.sampler, engine_module.build_metadata)
        graphs = e.graphs
        load = graphs._load if graphs is not None else None
        checks = e.checks
        checks.decode_arrays = self._timed("prepare", checks.decode_arrays, False)  # type: ignore[method-assign]
        e.collect = self._outputs(e.collect)  # type: ignore[method-assign]
        e.sampler = self._timed("sample", e.sampler, False)  # type: ignore[assignment]
        engine_module.build_metadata = self._timed("prepare", engine_module.build_metadata, True)
        if graphs is not None and load is not None:
            graphs._load = self._timed("prepare", load, True)  # type: ignore[method-assign]
        try:
            yield self
        finally:
            e.collect, e.sampler, engine_module.build_metadata = saved  # type: ignore[method-assign]
            del checks.decode_arrays
            if graphs is not None:
                del graphs._load

    def start_step(self) -> None:
        self.current = {}
        self._first = self._last = None

    def end_step(self) -> bool:
        """Whether the step launched anything (its busy time then comes from `finish`)."""
        if self._first is None:
            return False
        if self._last is None:  # a step that sampled nothing
            self._last = torch.cuda.Event(enable_timing=True)
            self._last.record()
        self.events.append((self._first, self._last))
        return True

    def finish(self, records: list[StepRecord]) -> None:
        """Fill the records' GPU busy times (one event pair per step that launched)."""
        if self.cuda:
            torch.cuda.synchronize()
        launched = [r for r in records if r.busy < 0]
        for record, (first, last) in zip(launched, self.events, strict=True):
            record.busy = first.elapsed_time(last) / 1000
        self.events = []


class CompileCounter:
    """Names of Triton kernels compiled while active (Triton's post-compile hook)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    @contextmanager
    def active(self) -> Iterator[CompileCounter]:
        try:
            from triton import knobs
        except ImportError:  # an older Triton: nothing counted
            yield self
            return
        saved = knobs.runtime.jit_post_compile_hook

        def hook(*, fn: Any, **_: Any) -> None:
            self.names.append(getattr(fn, "name", str(fn)))

        knobs.runtime.jit_post_compile_hook = hook
        try:
            yield self
        finally:
            knobs.runtime.jit_post_compile_hook = saved


def run_workload(
    engine: Engine, prompts: list[list[int]], out_len: int, profile: bool = True
) -> WorkloadRun:
    """All prompts at once (concurrency = len(prompts)), greedy, `out_len` tokens each."""
    n = len(prompts)
    core = Scheduler(
        SchedulerConfig(
            num_kv_blocks=engine.num_kv_blocks,
            block_size=engine.block_size,
            max_model_len=engine.config.max_seq_len,
            max_num_seqs=max(n, 1),
            async_scheduling=False,  # this loop runs one plan at a time
        )
    )
    for i, ids in enumerate(prompts):
        core.add_request(Request(i, ids, out_len, sampling=GREEDY))
    prof = StepProfile(engine)
    records: list[StepRecord] = []
    tokens = 0
    counter = CompileCounter()
    with counter.active(), prof.active():
        start = top = time.perf_counter()
        while core.has_unfinished():
            prof.start_step()
            plan = core.schedule()
            if plan.is_empty:
                continue
            t1 = time.perf_counter()
            engine.release(plan.finished_seq_ids)
            batch = [
                SeqInput(rid, toks, pos, table, GREEDY, sample)
                for rid, toks, pos, table, sample in zip(
                    plan.seq_ids,
                    plan.row_tokens(),
                    plan.start_pos,
                    plan.block_tables,
                    plan.sample,
                    strict=True,
                )
            ]
            t2 = time.perf_counter()
            outs = engine.step(batch)
            t3 = time.perf_counter()
            result = StepResult(
                plan.step_id, {cast(int, o.seq_id): (o.token_id, o.logprob) for o in outs}
            )
            tokens += sum(isinstance(e, Token) for e in core.update(plan, result))
            now = time.perf_counter()
            phases = prof.current
            records.append(
                StepRecord(
                    rows=plan.num_seqs,
                    prefill_tokens=plan.num_prefill_tokens,
                    wall=now - top,
                    schedule=t1 - top,
                    inputs=t2 - t1,
                    prepare=phases.get("prepare", 0.0),
                    sample=phases.get("sample", 0.0),
                    outputs=phases.get("outputs", 0.0),
                    update=now - t3,
                    busy=-1.0 if prof.end_step() else 0.0,
                )
            )
            top = now
        wall = time.perf_counter() - start
    prof.finish(records)
    return WorkloadRun(n, tokens, wall, tokens / wall, records if profile else [], counter.names)


def summarize_steps(records: list[StepRecord], rows: int) -> dict[str, float]:
    """Mean µs a step of the decode-only steps with `rows` rows, and of the prefill steps."""
    out: dict[str, float] = {}
    groups = {
        "decode": [r for r in records if r.prefill_tokens == 0 and r.rows == rows],
        "prefill": [r for r in records if r.prefill_tokens > 0],
    }
    for kind, group in groups.items():
        if not group:
            continue
        out[f"{kind}_steps"] = len(group)
        for name in (
            "wall",
            "busy",
            "schedule",
            "inputs",
            "prepare",
            "sample",
            "outputs",
            "update",
        ):
            out[f"{kind}_{name}_us"] = sum(getattr(r, name) for r in group) / len(group) * 1e6
        out[f"{kind}_idle_us"] = out[f"{kind}_wall_us"] - out[f"{kind}_busy_us"]
        out[f"{kind}_total_s"] = sum(r.wall for r in group)
    return out

"""The worker launching each step before reading the tokens of the one before it (on CUDA by
default) gives the outcomes that running one step at a time gives: through StepRunner, and
through the step ring's loop."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine import registry
from engine.engine import Engine
from engine.sampling_params import GREEDY, SamplingParams
from services.protocol import PLACEHOLDER, sampling_to_pb
from services.worker.metrics import WorkerMetrics
from services.worker.runner import InFlight, StepRunner
from services.worker.service import RingLoop
from services.worker.telemetry import WorkerTelemetry
from shm.consumer import RingConsumer
from shm.producer import RingProducer
from shm.reader import Reader
from tandem.internal.v1 import hotpath_pb2 as hp

SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=11)
PENALISED = SamplingParams(temperature=0.8, seed=5, frequency_penalty=0.7)
STEPS = 6


@pytest.fixture(scope="module")
def engine(tandem_home: Path) -> Engine:
    path = registry.resolve("llama3-tiny-random", tandem_home)
    return Engine.from_path(path, kv_cache_bytes=8 << 20, progress=False)


def plans() -> list[hp.StepDescriptor]:
    """Three sequences as an async scheduler plans them: whole prompts, then decodes whose token
    is the placeholder (what the worker sampled in the step before); the third finishes early."""
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 128256, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    sampling = [GREEDY, SEEDED, PENALISED]
    steps = []
    for k in range(STEPS):
        desc = hp.StepDescriptor(step_id=k + 1)
        for i, prompt in enumerate(prompts):
            if i == 2 and k >= 3:
                if k == 3:
                    desc.finished_seq_ids.append(i + 1)
                continue
            if k == 0:
                desc.new_seqs.add(
                    seq_id=i + 1,
                    prompt_ids=prompt,
                    prompt_len=len(prompt),
                    sampling=sampling_to_pb(sampling[i]),
                )
            desc.seq_ids.append(i + 1)
            desc.start_pos.append(0 if k == 0 else len(prompt) + k - 1)
            desc.num_tokens.append(len(prompt) if k == 0 else 1)
            desc.from_prompt.append(len(prompt) if k == 0 else 0)
            if k:
                desc.inline_tokens.append(PLACEHOLDER)
            desc.sample.append(True)
            desc.block_counts.append(2)
            desc.blocks.extend([2 * i, 2 * i + 1])
        steps.append(desc)
    return steps


def tokens(outcomes: list[hp.StepOutcome]) -> list[list[tuple[int, int]]]:
    for outcome in outcomes:
        assert not outcome.error and not outcome.failed_seq_ids
    return [list(zip(o.seq_ids, o.token_ids, strict=True)) for o in outcomes]


def through_ring(
    runner: StepRunner, descs: list[hp.StepDescriptor], overlap: bool
) -> list[hp.StepOutcome]:
    """The outcomes of `descs` through a RingLoop, all queued before it starts (as an async
    scheduler's two plans in flight are, and more), so that each step finds the next one
    waiting whatever the machine's pace."""
    steps = RingProducer.create(1 << 16)
    loop = RingLoop(runner, threading.Lock(), steps.name, overlap)
    results = RingConsumer.attach(loop.results.name)
    for desc in descs:
        steps.put(desc.SerializeToString())
    loop.start()
    try:
        return [hp.StepOutcome.FromString(results.get(timeout=60)) for _ in descs]
    finally:
        loop.stop()
        results.close()
        steps.close()


def one_at_a_time(engine: Engine) -> list[hp.StepOutcome]:
    runner = StepRunner(engine, Reader())
    outcomes = [runner.run(desc) for desc in plans()]
    runner.reset()
    return outcomes


def test_steps_launched_ahead_give_the_same_outcomes(engine: Engine) -> None:
    expected = tokens(one_at_a_time(engine))
    runner = StepRunner(engine, Reader())
    outcomes = []
    running = None
    for desc in plans():
        flight = runner.start(desc, running)
        if running is not None:
            outcomes.append(runner.finish(running))
        running = flight
    assert running is not None
    outcomes.append(runner.finish(running))
    runner.reset()
    assert tokens(outcomes) == expected
    assert [len(step) for step in expected] == [3, 3, 3, 2, 2, 2]


@pytest.mark.parametrize("overlap", [True, False])
def test_the_ring_loop_sends_every_outcome_in_order(engine: Engine, overlap: bool) -> None:
    expected = tokens(one_at_a_time(engine))
    outcomes = through_ring(StepRunner(engine, Reader()), plans(), overlap)
    assert [o.step_id for o in outcomes] == list(range(1, STEPS + 1))
    assert tokens(outcomes) == expected


def test_each_step_records_its_launch_time_within_its_duration(engine: Engine) -> None:
    metrics = WorkerMetrics("m")
    runner = StepRunner(engine, Reader(), WorkerTelemetry(metrics=metrics))
    for desc in plans():
        runner.run(desc)
    runner.telemetry.flush()
    runner.reset()

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "m", "kind": "decode"}) or 0

    duration = metrics.registry.get_sample_value(
        "tandem_step_duration_seconds_sum", {"model_name": "m"}
    )
    assert value("tandem_step_launch_seconds_count") == STEPS
    assert duration is not None and 0 < value("tandem_step_launch_seconds_sum") <= duration


class _Recording(StepRunner):
    """A StepRunner that notes the order in which steps are launched and finished."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine, Reader())
        self.order: list[str] = []

    def start(  # type: ignore[override]
        self, desc: hp.StepDescriptor, after: object = None, before_launch: object = None
    ) -> InFlight:
        self.order.append(f"start {desc.step_id}{' after' if after is not None else ''}")
        return super().start(desc, after, before_launch)  # type: ignore[arg-type]

    def finish(self, flight: InFlight) -> hp.StepOutcome:
        self.order.append(f"finish {flight.desc.step_id}")
        return super().finish(flight)


def test_a_step_with_prefill_is_launched_once_the_outcome_before_it_is_sent(
    engine: Engine,
) -> None:
    """Decode-only steps launch before the step before them is read; a step carrying prefill
    does its host work while the step before runs, and queues its kernels once that step's
    outcome is sent, so its long eager launch never holds those tokens."""
    steps_planned = plans()
    late = steps_planned[3]  # a fourth sequence's prompt joins the decodes of step 4
    prompt = list(range(100, 107))
    late.new_seqs.add(
        seq_id=4, prompt_ids=prompt, prompt_len=len(prompt), sampling=sampling_to_pb(GREEDY)
    )
    late.seq_ids.append(4)
    late.start_pos.append(0)
    late.num_tokens.append(len(prompt))
    late.from_prompt.append(len(prompt))
    late.sample.append(True)
    late.block_counts.append(2)
    late.blocks.extend([6, 7])
    late.num_prefill_tokens = len(prompt)
    steps_planned[0].num_prefill_tokens = 17
    alone = StepRunner(engine, Reader())
    expected = tokens([alone.run(desc) for desc in steps_planned])
    alone.reset()
    runner = _Recording(engine)
    order = runner.order
    hook = engine.model.register_forward_pre_hook(lambda *_: order.append("model"))
    try:
        outcomes = through_ring(runner, steps_planned, overlap=True)
    finally:
        hook.remove()
    assert [o.step_id for o in outcomes] == list(range(1, STEPS + 1))
    assert tokens(outcomes) == expected
    assert 4 in outcomes[3].seq_ids
    launched = order.index("model", order.index("start 4 after"))  # prefill: built ahead...
    assert order.index("start 4 after") < order.index("finish 3") < launched  # ...sent, launched
    assert order.index("start 3 after") < order.index("finish 2")  # decodes: overlapped


def test_a_step_with_prefill_that_fails_before_its_launch_still_sends_the_one_before(
    engine: Engine,
) -> None:
    """Its only sequence is refused as it is admitted, so nothing launches and the engine never
    calls back: the outcome of the step before goes out anyway, and in order."""
    steps_planned = plans()[:3]
    bad = hp.StepDescriptor(step_id=4, num_prefill_tokens=3)
    bad.new_seqs.add(
        seq_id=9, prompt_ids=[1, 2, 3], prompt_len=4, sampling=sampling_to_pb(GREEDY)
    )  # prompt_len says 4: refused
    bad.seq_ids.append(9)
    bad.start_pos.append(0)
    bad.num_tokens.append(3)
    bad.from_prompt.append(3)
    bad.sample.append(True)
    bad.block_counts.append(1)
    bad.blocks.append(6)
    outcomes = through_ring(StepRunner(engine, Reader()), [*steps_planned, bad], overlap=True)
    assert [o.step_id for o in outcomes] == [1, 2, 3, 4]
    assert tokens(outcomes[:3]) == tokens(one_at_a_time(engine))[:3]
    assert list(outcomes[3].failed_seq_ids) == [9]
    assert "prompt_len" in outcomes[3].failed_reasons[0]

"""Each process's telemetry, driven without processes: the scheduler's by its core's events, the
worker's by step records, the tokenizer's by the calls a Generate makes."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from services.errors import InvalidArgument
from services.protocol import StepPlan
from services.scheduler.events import Finished, Preempted, Queued, Resumed, Scheduled, Token
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.state import SchedulerStats
from services.scheduler.telemetry import SchedulerTelemetry
from services.telemetry.propagation import span_context_of
from services.telemetry.tracing import Tracing
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.telemetry import TokenizerTelemetry
from services.worker.metrics import WorkerMetrics
from services.worker.telemetry import WorkerTelemetry
from tandem.internal.v1 import hotpath_pb2 as hp
from tests.telemetry.conftest import Recorded

REQUEST_SPAN = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-00"


def stats(**kw: int) -> SchedulerStats:
    base = dict(
        num_running=0,
        num_waiting=0,
        num_preempted_waiting=0,
        kv_blocks_total=100,
        kv_blocks_used=0,
        kv_blocks_free=100,
        kv_blocks_cached=0,
        kv_blocks_session_pinned=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        num_evictions=0,
        num_steps=0,
        num_backlog_steps=0,
    )
    base.update(kw)
    return SchedulerStats(**base, num_finished={})  # type: ignore[arg-type]


def sample(
    metrics: SchedulerMetrics | WorkerMetrics | TokenizerMetrics, name: str, **labels: str
) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if value is None else value


def scheduler(recorded: Recorded) -> SchedulerTelemetry:
    telemetry = SchedulerTelemetry(recorded.tracing, SchedulerMetrics())
    telemetry.on_model("m")
    return telemetry


def test_a_request_is_queue_prefill_decode_under_its_request_span(recorded: Recorded) -> None:
    t = scheduler(recorded)
    t.on_submit(1, "r", REQUEST_SPAN, prompt_tokens=5, max_tokens=3, priority=2, session_id="s")
    t.on_events([Queued(1, 10.0, 1), Scheduled(1, 10.5, 0.5, 0)])
    t.on_events([Token(1, 7, -0.1, 0)])
    t.on_events([Preempted(1, 11.0, 6, "kv")])
    t.on_events([Resumed(1, 11.25, 0), Token(1, 8, -0.1, 1)])
    t.on_events([Token(1, 9, -0.1, 2), Finished(1, 1e9, "length", 3)])
    request = span_context_of(REQUEST_SPAN)
    assert request is not None
    queues, (prefill,), (decode,) = (recorded.named(n) for n in ("queue", "prefill", "decode"))
    assert len(queues) == 2
    first, again = sorted(queues, key=lambda s: s.start_time or 0)
    for span in (*queues, prefill, decode):
        assert span.parent is not None and span.parent.span_id == request.span_id
        assert span.context.trace_id == request.trace_id
        assert span.attributes["tandem.priority"] == 2
        assert span.attributes["tandem.session_id"] == "s"
    assert first.attributes["tandem.queue_s"] == 0.5
    assert (first.end_time or 0) - (first.start_time or 0) == 500_000_000
    assert again.attributes["tandem.preempted"] is True
    assert (again.end_time or 0) - (again.start_time or 0) == 250_000_000
    [event] = decode.events
    assert event.name == "preempted" and event.attributes["tandem.cause"] == "kv"
    assert decode.attributes["gen_ai.usage.output_tokens"] == 3
    assert decode.attributes["tandem.finish_reason"] == "length"
    assert decode.status.status_code is StatusCode.UNSET
    m = t.metrics
    assert sample(m, "tandem_request_queue_time_seconds_sum") == 0.5
    for name in ("prefill", "decode", "inference"):
        assert sample(m, f"tandem_request_{name}_time_seconds_count") == 1
    assert not t.requests


def test_a_failed_request_ends_its_open_span_with_an_error(recorded: Recorded) -> None:
    t = scheduler(recorded)
    t.on_submit(1, "r", REQUEST_SPAN, prompt_tokens=5, max_tokens=3, priority=0, session_id="")
    t.on_events([Queued(1, 1.0, 1), Finished(1, 2.0, "deadline", 0, "could not start")])
    [queue] = recorded.named("queue")
    assert queue.status.status_code is StatusCode.ERROR
    assert queue.status.description == "could not start"
    assert sample(t.metrics, "tandem_request_queue_time_seconds_count") == 0


def test_a_step_record_names_the_first_sampled_requests_phase_as_its_parent(
    recorded: Recorded,
) -> None:
    t = scheduler(recorded)
    unsampled, sampled = 1, 2
    for seq_id, parent in ((unsampled, UNSAMPLED), (sampled, REQUEST_SPAN)):
        t.on_submit(
            seq_id, f"r{seq_id}", parent, prompt_tokens=4, max_tokens=2, priority=0, session_id=""
        )
        t.on_events([Queued(seq_id, 1.0, 1), Scheduled(seq_id, 1.0, 0.0, 0)])
    desc = hp.StepDescriptor()
    plan = StepPlan(step_id=0, seq_ids=[unsampled, sampled], num_prefill_tokens=8)
    t.on_plan(plan, desc, stats(kv_blocks_used=2))
    assert desc.traceparent == t.requests[sampled].phase_parent
    assert desc.kv_blocks_used == 2
    # With no sampled request in the step, an unsampled parent makes the worker drop its span.
    lone = hp.StepDescriptor()
    t.on_plan(StepPlan(step_id=1, seq_ids=[unsampled]), lone, stats())
    assert lone.traceparent.endswith("-00")


def test_scheduler_counters_never_go_back_when_the_core_starts_over() -> None:
    t = SchedulerTelemetry(None, SchedulerMetrics())
    t.on_model("m")
    t.on_stats(
        stats(
            prefix_cache_queries=10,
            prefix_cache_hits=4,
            num_steps=3,
            num_backlog_steps=2,
            kv_blocks_used=25,
        )
    )
    t.on_stats(stats(prefix_cache_queries=2, num_steps=1, num_running=1, num_waiting=2))
    m = t.metrics
    assert sample(m, "tandem_prefix_cache_queries_total") == 12
    assert sample(m, "tandem_prefix_cache_hits_total") == 4
    assert sample(m, "tandem_scheduler_steps_total") == 4
    assert sample(m, "tandem_scheduler_backlog_steps_total") == 2
    assert sample(m, "tandem_num_requests_running") == 1
    assert sample(m, "tandem_num_requests_waiting") == 2
    assert sample(m, "tandem_kv_cache_usage_perc") == 0.0
    # Nothing was observed under the placeholder model name used before the worker was known.
    assert m.registry.get_sample_value("tandem_num_requests_running", {"model_name": ""}) is None


def test_with_tracing_off_the_scheduler_makes_no_spans_and_still_counts() -> None:
    t = SchedulerTelemetry(Tracing.off(), SchedulerMetrics())
    t.on_model("m")
    t.on_submit(1, "r", REQUEST_SPAN, prompt_tokens=1, max_tokens=1, priority=0, session_id="")
    t.on_events([Queued(1, 1.0, 1), Scheduled(1, 1.0, 0.0, 0), Token(1, 1, 0.0, 0)])
    assert t.requests[1].phase is None
    desc = hp.StepDescriptor()
    t.on_plan(StepPlan(step_id=0, seq_ids=[1]), desc, stats())
    assert desc.traceparent == ""
    t.on_events([Finished(1, 2.0, "length", 1)])
    assert sample(t.metrics, "tandem_request_prefill_time_seconds_count") == 1


def step(step_id: int, seq_ids: list[int], new: dict[int, str], parent: str) -> hp.StepDescriptor:
    desc = hp.StepDescriptor(
        step_id=step_id,
        seq_ids=seq_ids,
        block_counts=[1] * len(seq_ids),
        num_prefill_tokens=4 * len(new),
        num_decode_tokens=len(seq_ids) - len(new),
        kv_blocks_used=7,
        traceparent=parent,
    )
    for seq_id, traceparent in new.items():
        desc.new_seqs.add(seq_id=seq_id, traceparent=traceparent)
    return desc


def test_a_step_span_links_every_request_it_served(recorded: Recorded) -> None:
    metrics = WorkerMetrics("m")
    t = WorkerTelemetry(recorded.tracing, metrics)
    other = "00-2af7651916cd43dd8448eb211c80319c-d7ad6b7169203331-01"
    first = step(0, [1, 2, 3], {1: REQUEST_SPAN, 2: other, 3: UNSAMPLED}, REQUEST_SPAN)
    second = step(1, [1, 2, 3], {}, REQUEST_SPAN)
    for desc in (first, second):
        outcome = hp.StepOutcome(step_id=desc.step_id, seq_ids=[1, 2])
        t.record(desc, outcome, 10**18, 0.5, launch_s=0.125)
    assert not recorded.named("step")  # made only once the outcome is on its way
    t.flush()
    spans = recorded.named("step")
    assert len(spans) == 2
    request, linked = span_context_of(REQUEST_SPAN), span_context_of(other)
    for span in spans:
        assert span.parent is not None and request is not None and linked is not None
        assert span.parent.span_id == request.span_id
        assert {link.context.span_id for link in span.links} == {
            request.span_id,
            linked.span_id,
        }
        # The unsampled request has no span anywhere to link to.
        assert span.attributes["tandem.step.batch_size"] == 3
        assert span.attributes["tandem.kv.blocks_in_use"] == 7
        assert span.start_time == 10**18 and span.end_time == 10**18 + 500_000_000
    assert sample(metrics, "tandem_step_duration_seconds_count") == 2
    # The first step admits three prompts, the second only decodes.
    assert sample(metrics, "tandem_step_launch_seconds_count", kind="prefill") == 1
    assert sample(metrics, "tandem_step_launch_seconds_count", kind="decode") == 1
    assert sample(metrics, "tandem_step_launch_seconds_sum", kind="decode") == 0.125
    assert sample(metrics, "tandem_step_tokens_total", kind="prefill") == 12
    assert sample(metrics, "tandem_step_tokens_total", kind="decode") == 3
    assert sample(metrics, "tandem_iteration_tokens_total_sum") == 15


def test_a_failed_step_is_an_error_span_and_counted(recorded: Recorded) -> None:
    metrics = WorkerMetrics("m")
    t = WorkerTelemetry(recorded.tracing, metrics)
    desc = step(0, [1], {1: REQUEST_SPAN}, REQUEST_SPAN)
    t.record(desc, None, 10**18, 0.1, RuntimeError("boom"))
    t.flush()
    [failed] = recorded.named("step")
    assert failed.status.status_code is StatusCode.ERROR
    assert [e.name for e in failed.events] == ["exception"]
    assert sample(metrics, "tandem_step_failures_total") == 1


def generate_telemetry(recorded: Recorded) -> TokenizerTelemetry:
    return TokenizerTelemetry(recorded.tracing, TokenizerMetrics("m"), "m")


def test_a_generate_call_continues_the_callers_trace_and_counts(recorded: Recorded) -> None:
    telemetry = generate_telemetry(recorded)
    call = telemetry.begin([("traceparent", REQUEST_SPAN)])
    assert call.trace_id == "0af7651916cd43dd8448eb211c80319c"
    call.on_request(
        request_id="r",
        chat=True,
        temperature=0.5,
        top_p=0.9,
        top_k=0,
        seed=None,
        priority=1,
        session_id=None,
        output_format="json_schema",
    )
    with call.phase("tokenize"):
        pass
    assert span_context_of(call.traceparent) is not None
    call.on_submitted(prompt_tokens=4, max_tokens=8)
    call.on_tokens(0, 0.25)
    call.on_tokens(1, 0.0)
    call.on_tokens(2, 0.0)
    call.finish("stop", 3, 0)
    call.end()
    [root] = recorded.named("Generate")
    assert root.kind is SpanKind.SERVER
    assert root.parent is not None and root.parent.span_id == 0xB7AD6B7169203331
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["tandem.output_format"] == "json_schema" and a["gen_ai.output.type"] == "json"
    assert a["gen_ai.usage.input_tokens"] == 4 and a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.response.finish_reasons"] == ("stop",)
    assert a["tandem.queue_s"] == 0.25 and a["tandem.ttft_s"] > 0
    for name in ("tokenize", "stream"):
        [child] = recorded.named(name)
        assert child.parent is not None and child.parent.span_id == root.context.span_id
    m = telemetry.metrics
    assert sample(m, "tandem_prompt_tokens_total") == 4
    assert sample(m, "tandem_generation_tokens_total") == 3
    assert sample(m, "tandem_inter_token_latency_seconds_count") == 1
    assert sample(m, "tandem_request_success_total", finished_reason="stop") == 1
    assert sample(m, "tandem_tokenizer_requests_in_flight") == 0


@pytest.mark.parametrize(
    ("error", "reason", "status"),
    [
        (InvalidArgument("max_tokens", "must be positive"), "invalid_argument", StatusCode.ERROR),
        (RuntimeError("bug"), "internal", StatusCode.ERROR),
        (asyncio.CancelledError(), "cancelled", StatusCode.UNSET),
    ],
)
def test_a_failed_generate_call_records_why(
    recorded: Recorded, error: BaseException, reason: str, status: StatusCode
) -> None:
    telemetry = generate_telemetry(recorded)
    call = telemetry.begin(None)
    call.fail(error)
    call.end()
    [root] = recorded.named("Generate")
    assert root.status.status_code is status
    assert root.attributes["gen_ai.response.finish_reasons"] == (reason,)
    assert ("exception" in [e.name for e in root.events]) == (status is StatusCode.ERROR)
    assert sample(telemetry.metrics, "tandem_request_success_total", finished_reason=reason) == 1


def test_with_tracing_off_a_generate_call_echoes_the_callers_trace_id() -> None:
    telemetry = TokenizerTelemetry(Tracing.off(), TokenizerMetrics("m"), "m")
    call = telemetry.begin([("traceparent", REQUEST_SPAN)])
    assert call.trace_id == "0af7651916cd43dd8448eb211c80319c"
    assert call.traceparent == ""
    assert telemetry.begin(None).trace_id == ""

"""Traces and metrics of the real three-process pipeline, received by a real OTLP receiver.

The pipeline runs with OTEL_EXPORTER_OTLP_ENDPOINT pointing at an in-process OTLP/gRPC receiver
(opentelemetry-proto's TraceService), and each process serves /metrics on a port the launcher
picked. The client here is grpc's blocking one, like the receiver.
"""

from __future__ import annotations

import random
import secrets
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.pipeline import Pipeline, pipeline
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc
from tests.telemetry.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

SPAN_WAIT_S = 30.0
METRICS_WAIT_S = 30.0
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER
STATUS_ERROR = 2


@dataclass
class Served:
    responses: list[pb.GenerateResponse] = field(default_factory=list)

    @property
    def trace_id(self) -> str:
        return self.responses[0].trace_id

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.responses[0].prompt_token_ids)

    @property
    def last(self) -> pb.GenerateResponse:
        return self.responses[-1]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Pipeline]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        # Export within a tenth of a second, so the test need not wait for the shutdown flush.
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with pipeline(tmp_path_factory.mktemp("traced"), "--max-num-seqs", "8", env=env) as running:
        yield running


@pytest.fixture(scope="module")
def stub(served: Pipeline) -> Iterator[generation_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(served.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def generate(
    stub: generation_pb2_grpc.GenerationStub,
    request: pb.GenerateRequest,
    traceparent: str = "",
) -> Served:
    metadata = (("traceparent", traceparent),) if traceparent else None
    out = Served()
    for reply in stub.Generate(request, timeout=120, metadata=metadata):
        out.responses.append(reply)
    return out


def token_request(n_prompt: int, max_tokens: int, seed: int) -> pb.GenerateRequest:
    # Random ids: no prefix-cache hit, and shorter than a KV block, so no block is ever shared.
    rng = random.Random(seed)
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[rng.randrange(1000, 20000) for _ in range(n_prompt)]),
        max_tokens=max_tokens,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0),
    )


def of_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name}: {[s.name for s in spans]}"
    return found[0]


def test_one_trace_across_the_three_processes(
    stub: generation_pb2_grpc.GenerationStub, receiver: OtlpReceiver
) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    request = pb.GenerateRequest(
        text="The three primary colours are",
        max_tokens=6,
        sampling=pb.SamplingParams(temperature=0, top_p=0.9),
        priority=3,
        session_id="s-1",
    )
    got = generate(stub, request, f"00-{trace_id}-{client_span}-01")
    assert got.trace_id == trace_id  # the client's trace, continued
    n_out = got.last.usage.completion_tokens
    assert n_out == 6 and got.last.finish_reason == "length"

    def complete(spans: list[ReceivedSpan]) -> bool:
        mine = of_trace(spans, trace_id)
        names = [s.name for s in mine]
        return {"Generate", "decode", "stream"} <= set(names) and names.count("step") >= n_out

    spans = of_trace(receiver.wait_for(complete, SPAN_WAIT_S), trace_id)
    assert {s.service for s in spans} == {"tandem-tokenizer", "tandem-scheduler", "tandem-worker"}

    root = one(spans, "Generate")
    assert root.service == "tandem-tokenizer" and root.kind == SERVER_KIND
    assert root.parent_span_id == client_span
    for name in ("tokenize", "stream"):
        span = one(spans, name)
        assert span.service == "tandem-tokenizer" and span.parent_span_id == root.span_id
    queue, prefill, decode = (one(spans, n) for n in ("queue", "prefill", "decode"))
    for span in (queue, prefill, decode):
        assert span.service == "tandem-scheduler" and span.parent_span_id == root.span_id
        assert span.attributes["tandem.priority"] == 3
    assert queue.start_ns <= queue.end_ns <= prefill.start_ns + 1000
    assert prefill.end_ns <= decode.start_ns + 1000
    assert root.start_ns <= queue.start_ns and decode.end_ns <= root.end_ns
    assert decode.attributes["gen_ai.usage.output_tokens"] == n_out

    # The Submit call carried the context in its metadata: client span → server span.
    submits = [s for s in spans if s.name.endswith("Scheduler/Submit")]
    client = next(s for s in submits if s.service == "tandem-tokenizer")
    server = next(s for s in submits if s.service == "tandem-scheduler")
    assert client.parent_span_id == root.span_id and server.parent_span_id == client.span_id

    # Alone on the server: one prefill step, then one decode step per further token.
    steps = [s for s in spans if s.name == "step"]
    assert len(steps) == n_out
    assert all(s.service == "tandem-worker" for s in steps)
    assert all((trace_id, root.span_id) in s.links for s in steps)
    # A step's parent is the request's phase when the step was planned. With async scheduling
    # the step after the prompt's is planned while the prompt runs, so it may fall under
    # "prefill" too; every later one is a child of "decode".
    under_prefill = sum(s.parent_span_id == prefill.span_id for s in steps)
    assert 1 <= under_prefill <= 2
    assert sum(s.parent_span_id == decode.span_id for s in steps) == n_out - under_prefill
    first = min(steps, key=lambda s: s.start_ns)
    assert first.attributes["tandem.step.prefill_tokens"] == len(got.prompt_ids)
    assert first.attributes["tandem.step.batch_size"] == 1
    assert first.attributes["tandem.kv.blocks_in_use"] >= 1  # type: ignore[operator]
    assert all(s.attributes["tandem.step.decode_tokens"] == 1 for s in steps if s is not first)

    a = root.attributes
    assert a["gen_ai.request.model"] == "smollm2-135m-instruct"
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.input_tokens"] == got.last.usage.prompt_tokens == len(got.prompt_ids)
    assert a["gen_ai.usage.output_tokens"] == n_out
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["tandem.priority"] == 3 and a["tandem.session_id"] == "s-1"
    assert 0 < a["tandem.ttft_s"] < (root.end_ns - root.start_ns) / 1e9  # type: ignore[operator]
    assert a["tandem.queue_s"] >= 0  # type: ignore[operator]
    assert root.status_code != STATUS_ERROR


def test_a_new_trace_per_request_and_steps_link_every_request_they_served(
    stub: generation_pb2_grpc.GenerationStub, receiver: OtlpReceiver
) -> None:
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda i: generate(stub, token_request(5, 8, seed=100 + i)), range(4))
        )
    trace_ids = {r.trace_id for r in results}
    assert len(trace_ids) == 4 and all(len(t) == 32 for t in trace_ids)
    tokens = sum(r.last.usage.completion_tokens for r in results)

    def complete(spans: list[ReceivedSpan]) -> bool:
        # Every request's root has arrived, and so has every step that served one: a request
        # is linked from one step per token it was given.
        roots = {(s.trace_id, s.span_id) for s in spans if s.name == "Generate"}
        mine = {r for r in roots if r[0] in trace_ids}
        links = [link for s in spans if s.name == "step" for link in s.links if link in mine]
        return len(mine) == 4 and len(links) >= tokens

    spans = receiver.wait_for(complete, SPAN_WAIT_S)
    roots = {s.trace_id: s for s in spans if s.name == "Generate" and s.trace_id in trace_ids}
    wanted = {(t, r.span_id) for t, r in roots.items()}
    steps = [s for s in spans if s.name == "step" and wanted & set(s.links)]
    for step in steps:
        assert len(step.links) == step.attributes["tandem.step.batch_size"]
        # A step is a child of one of the requests it served, in that request's trace.
        assert any(step.trace_id == t for t, _ in step.links)
    assert wanted <= {link for s in steps for link in s.links}
    assert any(s.attributes["tandem.step.batch_size"] > 1 for s in steps)  # type: ignore[operator]
    for r in results:
        root = roots[r.trace_id]
        assert root.attributes["gen_ai.usage.output_tokens"] == r.last.usage.completion_tokens


def test_an_error_sets_the_span_status_and_records_the_exception(
    stub: generation_pb2_grpc.GenerationStub, receiver: OtlpReceiver
) -> None:
    trace_id = secrets.token_hex(16)
    request = pb.GenerateRequest(text="hi", max_tokens=0)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, request, f"00-{trace_id}-{secrets.token_hex(8)}-01")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def complete(spans: list[ReceivedSpan]) -> bool:
        return any(s.name == "Generate" for s in of_trace(spans, trace_id))

    root = one(of_trace(receiver.wait_for(complete, SPAN_WAIT_S), trace_id), "Generate")
    assert root.status_code == STATUS_ERROR
    assert "max_tokens" in root.status_message
    assert any(name == "exception" for name, _ in root.events)
    assert root.attributes["gen_ai.response.finish_reasons"] == ("invalid_argument",)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def test_metrics_count_what_was_served(
    served: Pipeline, stub: generation_pb2_grpc.GenerationStub
) -> None:
    assert set(served.metrics) == {"worker", "scheduler", "tokenizer-1"}
    before = {name: scrape(url) for name, url in served.metrics.items()}
    requests = [token_request(n, m, seed=n) for n, m in ((3, 4), (7, 9), (11, 2))]
    results = [generate(stub, r) for r in requests]
    prompt = sum(len(r.prompt_ids) for r in results)
    generated = sum(r.last.usage.completion_tokens for r in results)
    assert generated == 4 + 9 + 2 and prompt == 3 + 7 + 11

    def check(after: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]) -> None:
        def delta(process: str, name: str, **labels: str) -> float:
            key = (name, tuple(sorted(labels.items())))
            return after[process].get(key, 0.0) - before[process].get(key, 0.0)

        tok = "tokenizer-1"
        assert delta(tok, "tandem_prompt_tokens_total") == prompt
        assert delta(tok, "tandem_generation_tokens_total") == generated
        assert delta(tok, "tandem_request_success_total", finished_reason="length") == 3
        for histogram in (
            "tandem_time_to_first_token_seconds",
            "tandem_e2e_request_latency_seconds",
            "tandem_request_generation_tokens",
        ):
            assert delta(tok, f"{histogram}_count") == 3
        assert delta(tok, "tandem_request_generation_tokens_sum") == generated
        assert delta(tok, "tandem_inter_token_latency_seconds_count") == generated - 3
        assert after[tok][("tandem_tokenizer_requests_in_flight", ())] == 0
        assert after[tok][("tandem_shm_bytes_in_use", (("segment", "prompt_arena"),))] == 0

        sch = "scheduler"
        assert delta(sch, "tandem_prefix_cache_queries_total") == prompt
        assert delta(sch, "tandem_prefix_cache_hits_total") == 0
        assert delta(sch, "tandem_num_preemptions_total") == 0
        for histogram in ("queue", "prefill", "decode", "inference"):
            assert delta(sch, f"tandem_request_{histogram}_time_seconds_count") == 3
        steps = delta(sch, "tandem_scheduler_steps_total")
        assert steps == generated  # one at a time: a prefill step, then a step per further token
        # Every step's hops, each timed from its own send, also with the next step in flight.
        for direction in ("to_worker", "to_scheduler"):
            hops = delta(sch, "tandem_step_hop_seconds_count", direction=direction)
            assert hops == steps, (direction, hops, steps)
        assert after[sch][("tandem_num_requests_running", ())] == 0
        assert after[sch][("tandem_num_requests_waiting", ())] == 0
        assert after[sch][("tandem_kv_cache_usage_perc", ())] == 0

        wrk = "worker"
        assert delta(wrk, "tandem_step_duration_seconds_count") == steps
        assert delta(wrk, "tandem_step_batch_size_sum") == steps
        assert delta(wrk, "tandem_step_tokens_total", kind="prefill") == prompt
        assert delta(wrk, "tandem_step_tokens_total", kind="decode") == generated - 3
        assert delta(wrk, "tandem_iteration_tokens_total_sum") == prompt + generated - 3

    # Some metrics follow the last reply: the worker observes a step once its outcome is on its
    # way, and the scheduler's gauges are set when it next plans. Scrape until they agree.
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        try:
            check({name: scrape(url) for name, url in served.metrics.items()})
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def test_an_http_request_is_the_same_tree_as_a_grpc_one(
    served: Pipeline, receiver: OtlpReceiver
) -> None:
    import json

    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"prompt": "The three primary colours are", "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"{served.http_url}/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "traceparent": f"00-{trace_id}-{client_span}-01",
        },
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert json.loads(reply.read())["usage"]["completion_tokens"] == 4

    def complete(spans: list[ReceivedSpan]) -> bool:
        # Each process exports on its own schedule: wait for every span the test counts.
        names = [s.name for s in of_trace(spans, trace_id)]
        phases = {"Generate", "tokenize", "stream", "queue", "prefill", "decode"}
        return phases <= set(names) and names.count("step") >= 4

    spans = of_trace(receiver.wait_for(complete, SPAN_WAIT_S), trace_id)
    root = one(spans, "Generate")
    assert root.service == "tandem-tokenizer" and root.kind == SERVER_KIND
    assert root.parent_span_id == client_span
    assert root.attributes["http.route"] == "/v1/completions"
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    for name in ("tokenize", "stream", "queue", "prefill", "decode"):
        assert one(spans, name).parent_span_id == root.span_id
    assert len([s for s in spans if s.name == "step"]) == 4

"""The runner and the tandem backend against a fake tandem server with scripted delays.

No check depends on how fast this machine is: counts, orderings, values the runner computes
from its own records, and lower bounds set by the fake's own delays (a sleep never ends early).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import accumulate, islice

import grpc
import pytest
from conftest import StartTandem
from fake_tandem import Plan, index_of

from services.bench.config import BenchConfig, Target
from services.bench.metrics import summarize
from services.bench.report import table
from services.bench.runner import run
from services.bench.workload import arrival_gaps

# First token after 0.3 s, then three messages 0.2 s apart carrying 1, 2 and 1 tokens.
STEADY = Plan(steps=((0.3, 1), (0.2, 2), (0.2, 1), (0.2, 1)))


def config(address: str, **overrides: object) -> BenchConfig:
    args: dict[str, object] = {
        "targets": (Target("tandem", address),),
        "num_requests": 4,
        "progress": False,
        **overrides,
    }
    return BenchConfig(**args)  # type: ignore[arg-type]


async def test_ttft_itl_tokens_and_throughput(tandem_server: StartTandem) -> None:
    address, fake = await tandem_server(lambda _: STEADY)
    [result] = await run(config(address, num_requests=3, concurrency=3))
    assert len(result.records) == 3 and all(r.ok for r in result.records)
    for r in result.records:
        assert r.output_tokens == r.counted_tokens == 5
        assert (r.prompt_tokens, r.cached_prompt_tokens) == (5, 2)
        assert r.finish_reason == "length"
        assert r.ttft is not None and r.ttft >= 0.3
        itls = r.itls()
        # The two-token message gives two equal gaps (the runner splits its wait). Gaps are timed
        # where messages arrive, so one alone has no lower bound (a late message shortens the
        # next gap); their sum does: the fake sends the last message 0.9 s after the request.
        assert len(itls) == 4 and itls[0] == itls[1] and min(itls) > 0
        assert r.ttft + sum(itls) >= 0.9
        assert r.end is not None and r.end >= r.ttft + sum(itls)
    [s] = summarize(result.records, result.window)
    assert (s.ok, s.failed) == (3, 0)
    # Three requests at once, each at least 0.9 s: 15 tokens over the measured window.
    assert s.duration_s == pytest.approx(result.window[1] - result.window[0])
    assert s.duration_s >= 0.9
    assert s.output_throughput == pytest.approx(15 / s.duration_s)
    assert s.ttft_s.p50 < s.e2e_s.p50
    assert fake.max_in_flight == 3


async def test_requests_carry_the_workload(tandem_server: StartTandem) -> None:
    address, fake = await tandem_server(lambda _: Plan(steps=((0.0, 1),)))
    await run(config(address, prompt_len=12, output_len=9, ignore_eos=True, temperature=0.5))
    assert len(fake.requests) == 4
    for request in fake.requests:
        assert request.WhichOneof("prompt") == "text"
        assert len(request.text.split()) == 12
        assert request.max_tokens == 9
        assert request.ignore_eos
        assert request.sampling.temperature == pytest.approx(0.5)


async def test_chat_dataset_sends_messages(tandem_server: StartTandem) -> None:
    address, fake = await tandem_server(lambda _: Plan(steps=((0.0, 1),)))
    await run(config(address, dataset="chat", num_requests=2))
    assert [r.WhichOneof("prompt") for r in fake.requests] == ["chat", "chat"]


async def test_failures_are_counted_with_their_status(tandem_server: StartTandem) -> None:
    def plan(request: object) -> Plan:
        i = index_of(request)  # type: ignore[arg-type]
        if i % 2:
            return Plan(
                steps=((0.05, 1),), abort=(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
            )
        return Plan(steps=((0.05, 1), (0.05, 1)))

    address, _ = await tandem_server(plan)
    [result] = await run(config(address, num_requests=6, concurrency=2))
    failed = [r for r in result.records if not r.ok]
    assert [r.index for r in failed] == [1, 3, 5]
    assert {(r.status, r.message) for r in failed} == {("RESOURCE_EXHAUSTED", "queue full")}
    # A request that fails mid-stream keeps the tokens it saw, but not in the figures.
    assert all(r.counted_tokens == 1 for r in failed)
    [s] = summarize(result.records, result.window)
    assert (s.ok, s.failed) == (3, 3)
    assert s.output_tokens_mean == 2
    text = table([result])
    assert "3 / 3" in text
    assert "3 failed" in text and "3 × RESOURCE_EXHAUSTED: queue full" in text


async def test_an_unreachable_server_fails_every_request_visibly(closed_address: str) -> None:
    [result] = await run(config(closed_address, num_requests=2, timeout=20.0))
    assert [r.status for r in result.records] == ["UNAVAILABLE", "UNAVAILABLE"]
    assert "2 × UNAVAILABLE" in table([result])


async def test_a_request_past_the_timeout_fails_as_timeout(tandem_server: StartTandem) -> None:
    address, _ = await tandem_server(lambda _: Plan(steps=((0.05, 1), (30.0, 1))))
    # Time enough for the first token on a busy machine, far less than the second's wait.
    [result] = await run(config(address, num_requests=2, concurrency=2, timeout=5.0))
    assert {r.status for r in result.records} == {"TIMEOUT"}
    assert all(r.counted_tokens == 1 for r in result.records)


async def test_priority_mix_splits_the_table(tandem_server: StartTandem) -> None:
    address, fake = await tandem_server(lambda _: Plan(steps=((0.01, 1),)))
    [result] = await run(
        config(address, num_requests=40, concurrency=8, priority_mix=((0, 0.5), (10, 0.5)))
    )
    assert {r.priority for r in fake.requests} == {0, 10}
    groups = [s.group for s in summarize(result.records, result.window)]
    assert groups == ["all", "priority 0", "priority 10"]
    header = table([result]).splitlines()[1]
    assert "all" in header and "priority 0" in header and "priority 10" in header


async def test_warmup_is_sent_first_and_left_out(tandem_server: StartTandem) -> None:
    address, fake = await tandem_server(lambda _: Plan(steps=((0.01, 1),)))
    [result] = await run(config(address, num_requests=3, warmup=2, concurrency=4))
    assert [r.warmup for r in result.records] == [True, True, False, False, False]
    assert len(fake.requests) == 5
    warm_end = max(r.finished_at or 0 for r in result.records if r.warmup)
    assert result.window[0] >= warm_end
    [s] = summarize(result.records, result.window)
    assert s.ok == 3


async def test_rate_and_duration(tandem_server: StartTandem) -> None:
    address, _ = await tandem_server(lambda _: Plan(steps=((0.01, 1),)))
    # The Poisson arrivals that fall within one second at 20 per second, drawn from the seed;
    # the requests in flight then finish.
    arrivals = list(accumulate(islice(arrival_gaps(20.0, seed=0), 200)))
    expected = sum(t < 1.0 for t in arrivals)
    [result] = await run(config(address, num_requests=None, duration=1.0, rate=20.0))
    assert len(result.records) == expected > 5
    assert all(r.ok for r in result.records)
    # Each was sent no earlier than its arrival time.
    starts = sorted(r.start - result.window[0] for r in result.records)
    assert all(s >= t - 1e-3 for s, t in zip(starts, arrivals, strict=False))


async def test_fixed_concurrency_is_never_exceeded(tandem_server: StartTandem) -> None:
    address, fake = await tandem_server(lambda _: Plan(steps=((0.05, 1),)))
    await run(config(address, num_requests=12, concurrency=3))
    assert fake.max_in_flight == 3


async def test_the_same_requests_reach_every_target(tandem_server: StartTandem) -> None:
    a, fake_a = await tandem_server(lambda _: Plan(steps=((0.01, 1),)))
    b, fake_b = await tandem_server(lambda _: Plan(steps=((0.01, 1),)))
    cfg = config(a, random_range=0.5)
    results = await run(replace(cfg, targets=(Target("tandem", a), Target("tandem", b))))
    assert [r.target.url for r in results] == [a, b]
    assert [r.text for r in fake_a.requests] == [r.text for r in fake_b.requests]


async def test_an_http_port_fails_every_request_saying_so() -> None:
    http = ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{http.server_address[1]}"
    try:
        [result] = await run(config(address, num_requests=2, timeout=20.0))
    finally:
        http.shutdown()
        http.server_close()
    assert "2 × UNAVAILABLE: " + address + " answers, but not in gRPC (an HTTP port? " in table(
        [result]
    )


class _QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

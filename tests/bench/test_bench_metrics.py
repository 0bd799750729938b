"""Records → figures, on hand-made records with exact times (no servers, no clocks)."""

from __future__ import annotations

import math

import pytest

from services.bench.metrics import percentile, summarize
from services.bench.record import Event, RequestFailed, RequestRecord


def record(
    index: int,
    chunks: list[tuple[float, int]],
    end: float,
    *,
    priority: int = 0,
    start: float = 0.0,
    usage: int | None = None,
    warmup: bool = False,
) -> RequestRecord:
    r = RequestRecord(index, priority, warmup, start)
    for at, k in chunks:
        r.observe(Event(tokens=k), at)
    r.observe(Event(finish_reason="length", prompt_tokens=10, completion_tokens=usage), end)
    r.end = end
    return r


def failed(index: int, status: str, message: str, *, priority: int = 0) -> RequestRecord:
    r = RequestRecord(index, priority, False, 0.0)
    r.fail(RequestFailed(status, message), 0.5)
    return r


def test_ttft_is_the_first_token_message_and_itl_splits_multi_token_messages() -> None:
    r = record(0, [(0.2, 1), (0.3, 1), (0.5, 2), (0.6, 1)], end=0.65)
    assert r.ttft == 0.2
    assert r.itls() == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert r.counted_tokens == r.output_tokens == 5
    assert r.tpot() == pytest.approx((0.65 - 0.2) / 4)


def test_extra_tokens_of_the_first_message_give_no_gap() -> None:
    r = record(0, [(0.2, 3), (0.4, 1)], end=0.4)
    assert r.itls() == pytest.approx([0.2])


def test_output_tokens_come_from_usage_when_the_server_gives_it() -> None:
    r = record(0, [(0.1, 1), (0.2, 1)], end=0.3, usage=4)
    assert (r.counted_tokens, r.output_tokens) == (2, 4)
    assert r.tpot() == pytest.approx((0.3 - 0.1) / 3)


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_summary_counts_throughput_over_the_window_and_failures_by_status() -> None:
    records = [
        record(0, [(0.1, 1), (0.2, 1)], end=0.2, start=0.0),
        record(1, [(0.3, 1), (0.5, 3)], end=0.5, start=1.0),
        failed(2, "RESOURCE_EXHAUSTED", "queue full"),
        failed(3, "RESOURCE_EXHAUSTED", "queue full"),
        failed(4, "HTTP 503", "loading"),
        record(5, [(9.0, 100)], end=9.0, warmup=True),  # not in the figures
    ]
    [s] = summarize(records, (0.0, 2.0))
    assert (s.ok, s.failed) == (2, 3)
    assert s.duration_s == 2.0
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(6 / 2.0)
    assert s.total_token_throughput == pytest.approx((6 + 20) / 2.0)
    assert s.ttft_s.p50 == pytest.approx(0.2)
    assert s.ttft_s.count == 2
    assert s.itl_s.count == 1 + 3
    assert s.e2e_s.mean == pytest.approx(0.35)
    assert s.failures == {"RESOURCE_EXHAUSTED: queue full": 2, "HTTP 503: loading": 1}


def test_a_priority_mix_gives_one_summary_per_class() -> None:
    records = [
        record(0, [(0.1, 1)], end=0.1, priority=0),
        record(1, [(0.4, 1)], end=0.4, priority=10),
        record(2, [(0.2, 1)], end=0.2, priority=0),
        failed(3, "CANCELLED", "x", priority=10),
    ]
    groups = {s.group: s for s in summarize(records, (0.0, 1.0))}
    assert list(groups) == ["all", "priority 0", "priority 10"]
    assert (groups["priority 0"].ok, groups["priority 0"].failed) == (2, 0)
    assert (groups["priority 10"].ok, groups["priority 10"].failed) == (1, 1)
    assert groups["priority 10"].ttft_s.p50 == pytest.approx(0.4)
    # Each class over the whole window, so the classes add up to the total.
    assert groups["priority 0"].request_throughput == pytest.approx(2.0)


def test_an_all_failed_group_has_no_latencies_and_json_has_no_nan() -> None:
    [s] = summarize([failed(0, "UNAVAILABLE", "down")], (0.0, 1.0))
    assert s.ok == 0 and math.isnan(s.ttft_s.p99)
    data = s.to_json()
    assert data["ttft_s"]["p99"] is None
    assert data["failures"] == {"UNAVAILABLE: down": 1}

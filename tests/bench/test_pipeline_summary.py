"""bench/pipeline.py's summary of client-side token timelines."""

from __future__ import annotations

import pytest

from bench.pipeline import Timeline, summarize


def test_decode_rate_is_tokens_after_the_first_over_first_to_last() -> None:
    lines = [Timeline(0.0, [1.0, 1.1, 1.3, 1.4, 1.6]), Timeline(0.5, [2.0, 2.5]), Timeline(0.9, [])]
    s = summarize("t", 3, lines, wall=3.0)
    assert s.output_tokens == 7
    assert s.decode_tokens_per_s == pytest.approx((4 + 1) / (0.6 + 0.5))


def test_uneven_arrival_moves_the_median_gap_not_the_decode_rate() -> None:
    # A steady 0.2 s a token, delivered in pairs: gaps alternate 0.05 and 0.35.
    times = [1.0]
    for gap in [0.05, 0.35] * 10:
        times.append(times[-1] + gap)
    s = summarize("t", 1, [Timeline(0.0, times)], wall=10.0)
    assert s.decode_tokens_per_s == pytest.approx(5.0)
    assert 1000 / s.itl_p50_ms == pytest.approx(1 / 0.35)

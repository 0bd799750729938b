"""bench/profile_gpu.py's GPU span and idle time of a step, from its activity intervals."""

from __future__ import annotations

from bench.profile_gpu import span_and_idle


def test_idle_is_the_time_within_the_span_that_nothing_ran() -> None:
    # A 10 µs gap after the first kernel, 5 µs before the last; given out of order.
    assert span_and_idle([(40.0, 50.0), (0.0, 20.0), (30.0, 35.0)]) == (50.0, 15.0)


def test_overlapping_kernels_leave_no_idle_time() -> None:
    # Programmatic dependent launch: each starts before the one before ends, one inside another.
    assert span_and_idle([(0.0, 12.0), (10.0, 30.0), (12.0, 14.0), (29.0, 40.0)]) == (40.0, 0.0)


def test_a_kernel_inside_another_does_not_end_the_busy_time() -> None:
    assert span_and_idle([(0.0, 100.0), (10.0, 20.0), (110.0, 120.0)]) == (120.0, 10.0)

"""bench/gpu_clock.py reads nvidia-smi's samples: a phase's clock, power and clock-event reasons."""

from __future__ import annotations

from bench.gpu_clock import by_row, parse_samples, summarize

LINES = [
    "2026/12/03 07:56:23.015, 345, 81.96, 0x0000000000000001",
    "2026/12/03 07:56:24.015, 1500, 690.90, 0x0000000000000004",
    "2026/12/03 07:56:24.065, 1400, 699.20, 0x0000000000000000",
    "2026/12/03 07:56:24.115, [N/A], 699.20, 0x0000000000000000",
    "2026/12/03 07:56:24.1",
]


def test_well_formed_samples_are_read_and_the_rest_skipped() -> None:
    samples = parse_samples(LINES)
    assert [(s[1], s[2], s[3]) for s in samples] == [
        (345.0, 81.96, 1),
        (1500.0, 690.9, 4),
        (1400.0, 699.2, 0),
    ]
    assert samples[1][0] - samples[0][0] == 1.0


def test_a_phase_shows_the_median_clock_and_power_and_every_reason_inside_it() -> None:
    samples = parse_samples(LINES)
    start = samples[1][0]
    assert summarize(samples, start, start + 1) == "SM  1450 MHz,  695 W; reasons: power cap"
    assert summarize(samples, 0, start).endswith("reasons: idle")
    assert summarize(samples, start + 5, start + 6) == "no samples"


def test_each_row_gets_the_samples_from_the_row_before_it_or_its_own_start_to_its_end() -> None:
    samples = parse_samples(LINES)
    t = samples[0][0]
    first, second, third, fourth = by_row(
        samples, t - 1, [(None, t + 0.5), (None, t + 1.2), (t + 1.03, t + 1.2), (None, t + 9)]
    )
    assert first == {"sm_mhz": 345.0, "watts": 81.96, "clock_reasons": ["idle"]}
    assert second == {"sm_mhz": 1450.0, "watts": 695.05, "clock_reasons": ["power cap"]}
    assert third == {"sm_mhz": 1400.0, "watts": 699.2, "clock_reasons": []}  # set-up left out
    assert fourth == {}  # nothing sampled after the third row ended

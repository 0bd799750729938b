"""bench/power_limit.py reads nvidia-smi's samples and names the phase's clock-event reasons."""

from __future__ import annotations

from bench.power_limit import parse_samples, summarize

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

"""bench.goodput's search: the bracket it reports, how repeats decide a rate, and the seeds that
make two pipelines' runs of one rate alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.goodput import Sweep


class Scripted(Sweep):
    """A sweep whose runs hold up to `capacity` req/s, except the runs listed as flukes."""

    def __init__(self, capacity: float, flukes: frozenset[tuple[float, int]] = frozenset()):
        super().__init__("unused", {}, Path("unused"), 1.0, 1)
        self.capacity, self.flukes = capacity, flukes
        self.calls: list[tuple[float, int]] = []

    def run(self, name: str, shape: list[str], rate: float, repeat: int = 0) -> bool:
        self.calls.append((rate, repeat))
        return (rate <= self.capacity) != ((rate, repeat) in self.flukes)


def test_rates_grow_by_half_until_one_misses_then_the_bracket_is_halved() -> None:
    held, missed = Scripted(capacity=30.0).search("w", [], 12.0, 64.0, bisections=2)
    # 12, 18, 27 hold; 40.5 misses; 33.8 misses; 30.4 misses (above 30); so 27 .. 30.4.
    assert (held, missed) == (27.0, 30.4)
    # Up to 60.8 every rate holds; the next, 91.2, is past the 64 req/s the search stops at.
    assert Scripted(capacity=100.0).search("w", [], 12.0, 64.0, bisections=2) == (60.8, None)


def test_a_rate_holds_when_most_of_its_repeats_hold_and_runs_stop_once_that_is_known() -> None:
    fluke = Scripted(capacity=30.0, flukes=frozenset({(27.0, 0)}))
    assert fluke.search("w", [], 27.0, 27.0, bisections=0) == (0.0, 27.0)  # one run: a miss
    fluke = Scripted(capacity=30.0, flukes=frozenset({(27.0, 0)}))
    assert fluke.search("w", [], 27.0, 27.0, bisections=0, repeats=3) == (27.0, None)
    assert fluke.calls == [(27.0, 0), (27.0, 1), (27.0, 2)]
    clear = Scripted(capacity=30.0)
    assert clear.holds("w", [], 27.0, repeats=3) and clear.calls == [(27.0, 0), (27.0, 1)]
    assert not clear.holds("w", [], 40.0, repeats=4)  # two misses of four: not most


def test_the_seed_is_the_same_for_the_same_run_of_any_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeds: list[str] = []

    def bench(argv: list[str]) -> None:
        seeds.append(argv[argv.index("--seed") + 1])
        out = Path(argv[argv.index("--json") + 1])
        summary = {"ttft_s": {"p99": 0.1}, "itl_s": {"p99": 0.01}, "failed": 0}
        summary |= {"request_throughput": 1.0, "output_throughput": 1.0}
        out.write_text(json.dumps({"runs": [{"summary": [summary]}]}))

    monkeypatch.setattr("bench.goodput.tandem", bench)
    monkeypatch.setattr("bench.goodput.tail_shares", lambda metrics: dict)
    for _ in range(2):  # two pipelines
        sweep = Sweep("addr", {}, tmp_path, 1.0, 1)
        assert sweep.run("w", [], 12.0) and sweep.run("w", [], 12.0, repeat=1)
        assert sweep.run("other", [], 12.0)
    first, second = seeds[:3], seeds[3:]
    assert first == second and len(set(first)) == 3

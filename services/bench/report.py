"""What a run leaves behind: the table on the terminal and the JSON file."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.bench.config import BenchConfig
from services.bench.metrics import Distribution, Summary, summarize
from services.bench.runner import TargetRun

MS = 1e3


def _dist_rows(
    name: str,
    pick: Callable[[Summary], Distribution],
    scale: float,
    unit: str,
    digits: int = 1,
) -> list[tuple[str, Callable[[Summary], str]]]:
    def cell(q: int) -> Callable[[Summary], str]:
        return lambda s: _num(getattr(pick(s), f"p{q}") * scale, digits)

    return [(f"{name} p{q} ({unit})", cell(q)) for q in (50, 90, 99)]


ROWS: list[tuple[str, Callable[[Summary], str]]] = [
    ("requests ok / failed", lambda s: f"{s.ok} / {s.failed}"),
    ("duration (s)", lambda s: _num(s.duration_s, 2)),
    ("request throughput (req/s)", lambda s: _num(s.request_throughput, 2)),
    ("output throughput (tok/s)", lambda s: _num(s.output_throughput, 1)),
    ("total throughput (tok/s)", lambda s: _num(s.total_token_throughput, 1)),
    ("prompt tokens (mean)", lambda s: _num(s.prompt_tokens_mean, 1)),
    ("  of them cached (mean)", lambda s: _num(s.cached_prompt_tokens_mean, 1)),
    ("output tokens (mean)", lambda s: _num(s.output_tokens_mean, 1)),
    *_dist_rows("TTFT", lambda s: s.ttft_s, MS, "ms"),
    *_dist_rows("ITL", lambda s: s.itl_s, MS, "ms"),
    ("TPOT mean (ms)", lambda s: _num(s.tpot_s.mean * MS, 1)),
    *_dist_rows("E2E", lambda s: s.e2e_s, 1.0, "s", digits=3),
]


def _num(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def table(runs: Sequence[TargetRun]) -> str:
    """One column per target and group, one row per figure; failures listed below it."""
    columns = [(run.target.label, s) for run in runs for s in summarize(run.records, run.window)]
    label_width = max(len(name) for name, _ in ROWS)
    cells = [[fmt(s) for _, fmt in ROWS] for _, s in columns]
    widths = [
        max(len(target), len(s.group), *(len(c) for c in col))
        for (target, s), col in zip(columns, cells, strict=True)
    ]
    shown = [t if i == 0 or columns[i - 1][0] != t else "" for i, (t, _) in enumerate(columns)]
    lines = [
        _line("", shown, label_width, widths),
        _line("", [s.group for _, s in columns], label_width, widths),
    ]
    lines.append("-" * max(len(line) for line in lines))
    for i, (name, _) in enumerate(ROWS):
        lines.append(_line(name, [col[i] for col in cells], label_width, widths))
    lines += failure_lines(runs)
    return "\n".join(lines)


def _line(label: str, values: Sequence[str], label_width: int, widths: Sequence[int]) -> str:
    cells = (v.rjust(w) for v, w in zip(values, widths, strict=True))
    return "  ".join([label.ljust(label_width), *cells]).rstrip()


def failure_lines(runs: Sequence[TargetRun]) -> list[str]:
    lines: list[str] = []
    for run in runs:
        for warmup, what in ((False, "failed"), (True, "failed in warm-up")):
            records = [r for r in run.records if r.warmup == warmup]
            counts = Counter(f"{r.status}: {r.message}" for r in records if not r.ok)
            if counts:
                lines.append(f"{run.target.label}: {sum(counts.values())} {what}")
                lines += [f"  {n} × {status}" for status, n in counts.most_common()]
    return lines


def to_json(config: BenchConfig, runs: Sequence[TargetRun]) -> dict[str, Any]:
    return {
        "config": {**asdict(config), "targets": [asdict(t) for t in config.targets]},
        "runs": [
            {
                "target": asdict(run.target),
                "window_s": list(run.window),
                "summary": [s.to_json() for s in summarize(run.records, run.window)],
                "records": [r.to_json() for r in run.records],
            }
            for run in runs
        ],
    }


def write_json(path: Path, config: BenchConfig, runs: Sequence[TargetRun]) -> None:
    path.write_text(json.dumps(to_json(config, runs), indent=1) + "\n")

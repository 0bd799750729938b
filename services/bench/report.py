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
from services.bench.metrics import PERCENTILES, Summary, summarize
from services.bench.runner import TargetRun

MS = 1e3


Row = tuple[str, Callable[[Summary], str]]


def _dist_rows(name: str, field: str, unit: str, scale: float, digits: int = 1) -> list[Row]:
    def cell(q: int) -> Callable[[Summary], str]:
        return lambda s: _num(getattr(getattr(s, field), f"p{q}") * scale, digits)

    return [(f"{name} p{q} ({unit})", cell(q)) for q in PERCENTILES]


ROWS: list[Row] = [
    ("requests ok / failed", lambda s: f"{s.ok} / {s.failed}"),
    ("duration (s)", lambda s: _num(s.duration_s, 2)),
    ("request throughput (req/s)", lambda s: _num(s.request_throughput, 2)),
    ("output throughput (tok/s)", lambda s: _num(s.output_throughput, 1)),
    ("total throughput (tok/s)", lambda s: _num(s.total_token_throughput, 1)),
    ("prompt tokens (mean)", lambda s: _num(s.prompt_tokens_mean, 1)),
    ("  of them cached (mean)", lambda s: _num(s.cached_prompt_tokens_mean, 1)),
    ("output tokens (mean)", lambda s: _num(s.output_tokens_mean, 1)),
    *_dist_rows("TTFT", "ttft_s", "ms", MS),
    *_dist_rows("ITL", "itl_s", "ms", MS),
    ("TPOT mean (ms)", lambda s: _num(s.tpot_s.mean * MS, 1)),
    *_dist_rows("E2E", "e2e_s", "s", 1.0, digits=3),
]


def _num(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def table(runs: Sequence[TargetRun]) -> str:
    """One column per target and group, one row per figure; failures listed below it."""
    columns = [(run.target.label, s) for run in runs for s in summarize(run.records, run.window)]
    labels = [t for t, _ in columns]
    shown = [t if i == 0 or labels[i - 1] != t else "" for i, t in enumerate(labels)]
    rows = [["", *shown], ["", *(s.group for _, s in columns)]]
    rows += [[name, *(fmt(s) for _, s in columns)] for name, fmt in ROWS]
    # Every column is as wide as its target's label, shown or not.
    widths = [max(map(len, column)) for column in zip(["", *labels], *rows, strict=True)]
    lines = [
        "  ".join([row[0].ljust(widths[0]), *map(str.rjust, row[1:], widths[1:])]).rstrip()
        for row in rows
    ]
    lines.insert(2, "-" * max(len(line) for line in lines[:2]))
    return "\n".join(lines + failure_lines(runs))


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

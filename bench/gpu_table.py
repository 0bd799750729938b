"""bench.gpu's table: each measurement a row against its ceiling, printed as it comes and kept
for the JSON; where a workload's steps spent their time; and, at the end, the SM clock and power
each row ran at (bench/gpu_clock.py)."""

from __future__ import annotations

import time
from typing import Any

from bench.gpu_clock import Sample, by_row
from bench.serving import summarize_steps

ROWS: list[dict[str, Any]] = []
RATES: dict[str, float] = {}  # the hardware's, as measured at the start
BEGUN: list[float] = []  # when the next row's measurement began, where set up came before it


def show_steps(records: list[Any], n: int) -> None:
    """One line: where a decode step of n rows and the prefill steps spent their time (µs)."""
    s = summarize_steps(records, n)
    parts = []
    for kind in ("decode", "prefill"):
        if f"{kind}_steps" not in s:
            continue
        host = " ".join(
            f"{name} {s[f'{kind}_{name}_us']:.0f}"
            for name in ("schedule", "inputs", "prepare", "sample", "outputs", "update")
        )
        parts.append(
            f"{kind} x{s[f'{kind}_steps']:.0f}: wall {s[f'{kind}_wall_us']:.0f} busy "
            f"{s[f'{kind}_busy_us']:.0f} idle {s[f'{kind}_idle_us']:.0f} ({host}) "
            f"total {s[f'{kind}_total_s']:.2f}s"
        )
    print("    " + " | ".join(parts), flush=True)


def begin() -> None:
    """The next row's measurement starts now: its clock window leaves out the set-up before."""
    BEGUN[:] = [time.time()]


def row(
    case: str,
    system: str,
    value: float,
    unit: str,
    ceiling: float = 0.0,
    sustained: float = 0.0,
    **extra: Any,
) -> None:
    """`ceiling` at the measured rates; `sustained`, where prefill FLOPs count, the same ceiling
    with them at the matmul rate the card holds (bench.gpu_measure.sustained_matmul_rate)."""
    ratio = value / ceiling if ceiling else None
    held = value / sustained if sustained else None
    if unit == "ms" and ratio is not None:
        shown = f"{ratio:5.2f}x floor"
        shown += f" (sustained: {held:4.2f}x)" if held is not None else ""
    elif ratio is not None:
        shown = f"{ratio:6.1%}"
        shown += f" (sustained: {held:.1%})" if held is not None else ""
    else:
        shown = ""
    ROWS.append(
        {
            "case": case,
            "system": system,
            "value": value,
            "unit": unit,
            "ceiling": ceiling or None,
            "ratio": ratio,
            **({"sustained_ceiling": sustained, "sustained_ratio": held} if sustained else {}),
            **extra,
            # Its window of the clock samples: from the row before it (or begin()) to here.
            "began_at": BEGUN.pop() if BEGUN else None,
            "ended_at": time.time(),
        }
    )
    print(f"{case:<34} {system:<26} {value:>10.1f} {unit:<8} {shown}", flush=True)


def show_clock(samples: list[Sample], started: float) -> None:
    """Each row's SM clock and power (nvidia-smi, every 50 ms) from the row before it to its own
    end, into the row and as a table: where the power limit slowed the clock, it names it."""
    if not samples:
        return
    print(f"\n{'case':<34} {'system':<26} {'SM MHz':>7} {'W':>5}  clock reasons")
    spans = [(r["began_at"], r["ended_at"]) for r in ROWS]
    for r, w in zip(ROWS, by_row(samples, started, spans), strict=True):
        r.update(w)
        if w:
            reasons = ", ".join(w["clock_reasons"]) or "none"
            clock = f"{w['sm_mhz']:7.0f} {w['watts']:5.0f}"
            print(f"{r['case']:<34} {r['system']:<26} {clock}  {reasons}")

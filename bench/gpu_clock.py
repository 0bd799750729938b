"""The GPU's SM clock, power and clock-event reasons while a benchmark runs: `nvidia-smi` sampled
every 50 ms in the background, read back, and summarised over a phase's time window.

An H200 at its 700 W limit lowers its SM clock (bench/RESULTS-gpu.md, the power limit), and the
same kernels then take longer; a row's clock and power say whether it ran there.
"""

from __future__ import annotations

import datetime
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"
# Bits of clocks_event_reasons.active (nvml's nvmlClocksEventReason*).
REASONS = {0x1: "idle", 0x4: "power cap", 0x8: "HW slowdown", 0x20: "thermal (SW)",
           0x40: "thermal (HW)", 0x80: "power brake"}  # fmt: skip

Sample = tuple[float, float, float, int]  # epoch seconds, SM MHz, watts, reason bits


def parse_samples(lines: list[str]) -> list[Sample]:
    """(epoch seconds, SM MHz, watts, reason bits) of each well-formed CSV line of nvidia-smi."""
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((when, float(parts[1]), float(parts[2]), int(parts[3], 16)))
        except (ValueError, IndexError):
            continue  # a header, "[N/A]" or a line cut off when the sampler stopped
    return samples


def window(samples: list[Sample], start: float, end: float) -> dict[str, Any]:
    """The median SM clock and power of the samples in [start, end), and every reason among
    them; empty where none fell inside."""
    inside = [s for s in samples if start <= s[0] < end]
    if not inside:
        return {}
    bits = 0
    for s in inside:
        bits |= s[3]
    return {
        "sm_mhz": statistics.median(s[1] for s in inside),
        "watts": statistics.median(s[2] for s in inside),
        "clock_reasons": [name for bit, name in REASONS.items() if bits & bit],
    }


def summarize(samples: list[Sample], start: float, end: float) -> str:
    w = window(samples, start, end)
    if not w:
        return "no samples"
    reasons = ", ".join(w["clock_reasons"]) or "none"
    return f"SM {w['sm_mhz']:5.0f} MHz, {w['watts']:4.0f} W; reasons: {reasons}"


@contextmanager
def sampling(path: Path) -> Iterator[None]:
    """Samples into `path` while the block runs; where there is no nvidia-smi, writes nothing."""
    if shutil.which("nvidia-smi") is None:
        yield
        return
    with path.open("w") as out:
        cmd = ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "50"]
        sampler = subprocess.Popen(cmd, stdout=out)
        try:
            time.sleep(0.5)
            yield
        finally:
            sampler.terminate()
            sampler.wait()


def by_row(
    samples: list[Sample], start: float, spans: list[tuple[float | None, float]]
) -> list[dict[str, Any]]:
    """The window of each row measured after the one before it: (when its measurement began, or
    None for the previous row's end, the first's `start`; when it ended)."""
    windows = []
    for began, ended in spans:
        windows.append(window(samples, start if began is None else began, ended))
        start = ended
    return windows

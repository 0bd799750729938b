"""The PNG of a run: latency CDFs (TTFT, ITL, end-to-end) and output tokens/s over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# The Figure API, not pyplot: it renders with Agg into the file and touches no global backend
# or display, so it works on servers and in CI.
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from services.bench.metrics import groups
from services.bench.record import RequestRecord
from services.bench.runner import TargetRun

MAX_BINS = 60


def write_plot(path: Path, runs: Sequence[TargetRun]) -> None:
    fig = Figure(figsize=(13, 8.5), layout="constrained")
    axes = fig.subplots(2, 2)
    ttft, itl, e2e, throughput = axes.flat
    for run in runs:
        for group, records in groups(run.records):
            ok = [r for r in records if r.ok]
            label = run.target.label if group == "all" else f"{run.target.label} {group}"
            _cdf(ttft, [t * 1e3 for r in ok if (t := r.ttft) is not None], label)
            _cdf(itl, [g * 1e3 for r in ok for g in r.itls()], label)
            _cdf(e2e, [r.end for r in ok if r.end is not None], label)
        _throughput(throughput, run.measured, run.window, run.target.label)
    for ax, title, unit in (
        (ttft, "time to first token", "ms"),
        (itl, "inter-token latency", "ms"),
        (e2e, "end-to-end latency", "s"),
    ):
        ax.set(
            title=title,
            xlabel=unit,
            ylabel="fraction of requests" if ax is not itl else "fraction of gaps",
            ylim=(0, 1.02),
        )
    throughput.set(
        title="output throughput", xlabel="s since the measured phase began", ylabel="tokens/s"
    )
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def _cdf(ax: Axes, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    n = len(ordered)
    ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=label)


def _throughput(
    ax: Axes, records: Sequence[RequestRecord], window: tuple[float, float], label: str
) -> None:
    """Tokens as they arrived, in equal bins over the window, over each bin's width."""
    start, end = window
    span = end - start
    if span <= 0:
        return
    width = max(span / MAX_BINS, min(1.0, span / 10))
    bins = [0] * (int(span / width) + 1)
    for r in records:
        for at, k in r.chunks:
            bins[min(int((r.start + at - start) / width), len(bins) - 1)] += k
    ax.plot([(i + 0.5) * width for i in range(len(bins))], [n / width for n in bins], label=label)

"""From records to the figures of the table: counts, throughput, latency percentiles."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from services.bench.record import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(len(values), _mean(values), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    """The figures of one group of measured requests (all of them, or one priority class)."""

    group: str  # "all" or "priority N"
    ok: int
    failed: int
    duration_s: float  # the measured window, the same for every group of a target
    request_throughput: float  # ok requests per second
    output_throughput: float  # output tokens of ok requests per second
    total_token_throughput: float  # prompt + output tokens of ok requests per second
    prompt_tokens_mean: float  # as the servers reported them
    # Of those, served from a prefix cache: a rerun with the same --seed sends the same
    # prompts, and a server that kept their KV skips their prefill.
    cached_prompt_tokens_mean: float
    output_tokens_mean: float
    ttft_s: Distribution
    itl_s: Distribution
    tpot_s: Distribution
    e2e_s: Distribution
    failures: dict[str, int] = field(default_factory=dict)  # "STATUS: message" → count

    def to_json(self) -> dict[str, Any]:
        return _finite(asdict(self))


def groups(records: Sequence[RequestRecord]) -> list[tuple[str, list[RequestRecord]]]:
    """The measured requests: all of them, then each priority class if there are two or more."""
    measured = [r for r in records if not r.warmup]
    out = [("all", measured)]
    classes = sorted({r.priority for r in measured})
    if len(classes) > 1:
        out += [(f"priority {p}", [r for r in measured if r.priority == p]) for p in classes]
    return out


def summarize(records: Sequence[RequestRecord], window: tuple[float, float]) -> list[Summary]:
    """A summary per group; every class's throughput is over the target's whole window."""
    return [_summary(name, members, window) for name, members in groups(records)]


def _summary(group: str, records: Sequence[RequestRecord], window: tuple[float, float]) -> Summary:
    ok = [r for r in records if r.ok]
    duration = window[1] - window[0]
    output = sum(r.output_tokens for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]

    def per_s(n: float) -> float:
        return n / duration if duration > 0 else math.nan

    return Summary(
        group=group,
        ok=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration,
        request_throughput=per_s(len(ok)),
        output_throughput=per_s(output),
        total_token_throughput=per_s(output + sum(prompts)),
        prompt_tokens_mean=_mean(prompts),
        cached_prompt_tokens_mean=_mean(
            [r.cached_prompt_tokens for r in ok if r.cached_prompt_tokens is not None]
        ),
        output_tokens_mean=_mean([r.output_tokens for r in ok]),
        ttft_s=Distribution.of([t for r in ok if (t := r.ttft) is not None]),
        itl_s=Distribution.of([gap for r in ok for gap in r.itls()]),
        tpot_s=Distribution.of([t for r in ok if (t := r.tpot()) is not None]),
        e2e_s=Distribution.of([r.end for r in ok if r.end is not None]),
        failures=dict(Counter(f"{r.status}: {r.message}" for r in records if not r.ok)),
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _finite(value: Any) -> Any:
    # JSON has no NaN: an empty distribution's figures become null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value

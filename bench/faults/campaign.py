"""One campaign's result, in the shape RESULTS-reliability.json keeps, and what every campaign
measures the same way once its load has drained: leaks, crashes, the arenas' live bytes."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from bench.faults.outcome import Tally
from bench.faults.served import Served, drained, leaked_blocks

_ARENA_IN_USE = re.compile(r'tandem_shm_bytes_in_use\{[^}]*segment="prompt_arena"[^}]*\} (\S+)')


@dataclass
class Campaign:
    name: str
    tally: Tally = field(default_factory=Tally)
    leaked_shm: int = 0
    leaked_kv_blocks: int = 0
    crashed_processes: int = 0
    wall_s: float = 0.0
    # Campaign-specific measurements (recovery times, memory growth, TTFT, ...).
    extra: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        kinds = self.tally.kinds
        return {
            "name": self.name,
            "requests": self.tally.requests,
            "ok": kinds["ok"],
            "clear_error": kinds["clear_error"],
            "unclear_error": kinds["unclear_error"],
            "hung": kinds["hung"],
            "leaked_shm": self.leaked_shm,
            "leaked_kv_blocks": self.leaked_kv_blocks,
            "crashed_processes": self.crashed_processes,
            "wall_s": round(self.wall_s, 1),
            "statuses": dict(sorted(self.tally.codes.items())),
            "error_examples": self.tally.examples,
            "unclear_examples": self.tally.unclear,
            **self.extra,
            "notes": self.notes,
        }


def arena_bytes_in_use(served: Served) -> int:
    """Prompt-arena bytes still allocated, summed over the tokenizers (their /metrics)."""
    total = 0
    for name, url in served.pipe.metrics.items():
        if not name.startswith("tokenizer"):
            continue
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        total += sum(int(float(m[1])) for m in _ARENA_IN_USE.finditer(text))
    return total


async def after_drain(served: Served, result: Campaign) -> None:
    """Once the campaign's load is done: KV and arena bytes still held, dead processes' shm."""
    stats = await drained(served)
    result.leaked_kv_blocks = leaked_blocks(stats)
    if stats is not None:
        result.extra["finished_by_reason"] = dict(sorted(stats.finished.items()))
        result.extra["kv_blocks_total"] = stats.kv_blocks_total
    else:
        result.notes.append("the load did not drain within the bound: KV counted as leaked (-1)")
    result.extra["leaked_arena_bytes"] = arena_bytes_in_use(served)
    result.extra["dead_shm_while_serving"] = served.dead_shm()


def close(served: Served, result: Campaign) -> Campaign:
    """After `tandem serve` stopped: what it left in /dev/shm, who crashed."""
    dead = result.extra.get("dead_shm_while_serving", [])
    result.leaked_shm = len(set(dead) | set(served.shm_after_stop))
    result.extra["shm_left_after_stop"] = served.shm_after_stop
    crashes = served.crashes()
    result.crashed_processes = len(crashes)
    result.extra["crashes"] = crashes
    result.extra["sigkills_sent"] = dict(served.kills)
    result.extra["stuck_on_stop"] = served.stuck_on_stop
    result.extra["tracebacks_logged"] = served.errors_logged()
    return result

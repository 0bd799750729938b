"""A snapshot of the scheduler's gauges and counters, for metrics and the describe RPC."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.policy import Scheduler


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    # Of the waiting requests, those that were preempted and will resume.
    num_preempted_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    # Free includes cached blocks: they are given up on demand.
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_session_pinned: int
    # Prompt tokens looked up in the prefix cache at first admission, and those found.
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_evictions: int
    num_steps: int
    # Finished requests by reason ("stop", "length", "cancelled", "deadline", "error").
    num_finished: Mapping[str, int]

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0


def snapshot(s: Scheduler) -> SchedulerStats:
    blocks = s.blocks
    return SchedulerStats(
        num_running=len(s.running),
        num_waiting=s.waiting.count,
        num_preempted_waiting=s.num_preempted_waiting,
        kv_blocks_total=blocks.num_blocks,
        kv_blocks_used=blocks.num_used,
        kv_blocks_free=blocks.num_free,
        kv_blocks_cached=blocks.num_cached,
        kv_blocks_session_pinned=s.sessions.num_pinned,
        prefix_cache_queries=s.prefix_queries,
        prefix_cache_hits=s.prefix_hits,
        num_preemptions=s.num_preemptions,
        num_evictions=blocks.num_evictions,
        num_steps=s.next_step_id,
        num_finished=dict(s.num_finished),
    )

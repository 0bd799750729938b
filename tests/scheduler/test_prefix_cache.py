"""Prefix caching: shared full blocks are ref-counted, a full hit still recomputes the last
token, cached blocks are evicted least-recently-used, and sessions pin their last turn."""

from __future__ import annotations

from services.scheduler.events import Scheduled
from services.scheduler.request import Request

from .utils import create_requests, create_rig, expected_tokens, name, of_type, sid, tokens_of

PREFIX = list(range(1, 13))  # three full blocks of 4


def cached_tokens(events: list, request_id: str) -> int:
    (e,) = [e for e in of_type(events, Scheduled) if name(e.seq_id) == request_id]
    return e.num_cached_tokens


def test_requests_sharing_a_prefix_share_its_blocks() -> None:
    rig = create_rig()
    sched = rig.scheduler
    (a,) = create_requests(1, id_prefix="a", prefix=PREFIX, prompt_len=5, max_tokens=6)
    rig.add(a)
    plan_a, _ = rig.step()
    (b,) = create_requests(1, id_prefix="b", prefix=PREFIX, prompt_len=6, max_tokens=2)
    rig.add(b)
    plan, events = rig.step()
    assert cached_tokens(events, "b0") == 12
    (row_b,) = [s for s in plan.seqs if name(s.seq_id) == "b0"]
    # Only the 6 tokens after the prefix are computed, into fresh blocks after the shared ones.
    assert (row_b.start_pos, len(row_b.token_ids)) == (12, 6)
    shared = plan_a.seqs[0].block_table[:3]
    assert row_b.block_table[:3] == shared
    assert [sched.blocks.ref_counts[x] for x in shared] == [2, 2, 2]
    events += rig.run()
    assert [sched.blocks.ref_counts[x] for x in shared] == [0, 0, 0]
    assert all(sched.blocks.block_hashes[x] is not None for x in shared)
    assert tokens_of(events, "b0") == expected_tokens(b, 2)
    stats = sched.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached >= 3
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (17 + 18, 12)


def test_a_whole_prompt_hit_still_recomputes_the_last_token() -> None:
    rig = create_rig()
    rig.add(Request(sid("first"), [*PREFIX, 13], 1))
    rig.run()
    # 13 tokens: the first 12 are cached, exactly one is recomputed and sampled.
    rig.add(Request(sid("again"), [*PREFIX, 13], 1))
    plan, events = rig.step()
    assert cached_tokens(events, "again") == 12
    assert [(s.start_pos, len(s.token_ids), s.sample) for s in plan.seqs] == [(12, 1, True)]
    # 12 tokens, all in full blocks: the last block is recomputed so the last token has logits.
    rig.add(Request(sid("exact"), PREFIX, 1))
    plan, events = rig.step()
    assert cached_tokens(events, "exact") == 8
    assert [(s.start_pos, len(s.token_ids), s.sample) for s in plan.seqs] == [(8, 4, True)]


def test_a_request_that_reuses_no_prefix_computes_its_whole_prompt() -> None:
    """reuse_prefix False (a prompt to score): no hit is taken, but its blocks are offered."""
    rig = create_rig()
    rig.add(Request(sid("first"), [*PREFIX, 13], 1))
    rig.run()
    rig.add(Request(sid("scored"), [*PREFIX, 14, 15, 16, 17, 18], 1, reuse_prefix=False))
    plan, events = rig.step()
    assert cached_tokens(events, "scored") == 0
    assert [(s.start_pos, len(s.token_ids)) for s in plan.seqs] == [(0, 17)]
    rig.run()
    # Its blocks went to the cache as any request's: its fourth (14..17) is found after it.
    rig.add(Request(sid("after"), [*PREFIX, 14, 15, 16, 17, 19], 1))
    _, events = rig.step()
    assert cached_tokens(events, "after") == 16


def test_cached_blocks_are_evicted_least_recently_used() -> None:
    rig = create_rig(num_kv_blocks=16, block_size=4)
    rig.add(Request(sid("a"), list(range(100, 108)), 1))
    rig.run()
    rig.add(Request(sid("b"), list(range(200, 208)), 1))
    rig.run()
    # 14 blocks: the 12 never-hashed ones, then the two least recently freed (a's).
    rig.add(Request(sid("big"), list(range(300, 356)), 1))
    rig.run()
    assert rig.scheduler.stats().num_evictions == 2
    rig.add(Request(sid("b2"), list(range(200, 208)), 1))
    _, events = rig.step()
    assert cached_tokens(events, "b2") == 4
    rig.add(Request(sid("a2"), list(range(100, 108)), 1))
    _, events = rig.step()
    assert cached_tokens(events, "a2") == 0


def test_with_caching_off_nothing_is_shared() -> None:
    rig = create_rig(enable_prefix_caching=False)
    rig.add(*create_requests(1, id_prefix="a", prefix=PREFIX))
    rig.run()
    rig.add(*create_requests(1, id_prefix="b", prefix=PREFIX))
    _, events = rig.step()
    assert cached_tokens(events, "b0") == 0
    assert rig.scheduler.stats().kv_blocks_cached == 0


def test_concurrent_identical_prefixes_keep_one_cached_copy() -> None:
    rig = create_rig()
    rig.add(*create_requests(3, prefix=PREFIX, prompt_len=2, max_tokens=3))
    rig.run()
    assert rig.scheduler.stats().kv_blocks_cached == 3 + 3  # one prefix, each own block once


def session_turns(session_id: str | None, others: list[int]) -> tuple[int, int]:
    """Turn 1, other requests one after another (prompt lengths `others`), turn 2 of one
    conversation. Returns the cached tokens turn 2 found, and the session-pinned blocks after
    the other traffic ran."""
    rig = create_rig(num_kv_blocks=16, block_size=4, session_kv_fraction=0.5)
    first = Request(sid("t1"), list(range(500, 510)), 6, session_id=session_id)
    rig.add(first)
    rig.run()
    history = rig.worker.truth[sid("t1")]  # its prompt and its 6 answer tokens
    for i, n in enumerate(others):
        rig.add(Request(sid(f"other{i}"), list(range(1000 * (i + 1), 1000 * (i + 1) + n)), 1))
        rig.run()
    pinned = rig.scheduler.stats().kv_blocks_session_pinned
    rig.add(Request(sid("t2"), [*history, 7, 8, 9, 10], 2, session_id=session_id))
    _, events = rig.step()
    rig.run()
    # Turn 2 pins its own 5 full blocks (21 tokens computed) for turn 3.
    assert rig.scheduler.stats().kv_blocks_used == (5 if session_id else 0)
    return cached_tokens(events, "t2"), pinned


def test_a_session_keeps_its_last_turn_cached_through_other_traffic() -> None:
    # Turn 1 computed 15 tokens: three full blocks (12 tokens) are worth keeping. Two requests
    # of 9 blocks each then pass through the 16-block pool.
    assert session_turns("chat-1", others=[36, 36]) == (12, 3)
    # Without a session, LRU eviction takes turn 1's blocks (older than the first request's).
    assert session_turns(None, others=[36, 36]) == (0, 0)


def test_session_pins_give_way_under_memory_pressure() -> None:
    # This request needs 15 of the 16 blocks: the pins are released rather than refusing it.
    hits, pinned = session_turns("chat-1", others=[60])
    assert pinned == 0 and hits < 12

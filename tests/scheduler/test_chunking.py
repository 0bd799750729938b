"""Chunked prefill: long prompts are split across steps, never stall decodes, and at most
`max_long_prefills` of them run at once."""

from __future__ import annotations

from services.scheduler.events import Scheduled

from .utils import (
    create_requests,
    create_rig,
    create_simulation,
    expected_tokens,
    name,
    of_type,
    sid,
)


def rows(plan) -> list[tuple[str, int, int, bool]]:
    return [(name(s.seq_id), s.start_pos, len(s.token_ids), s.sample) for s in plan.seqs]


def test_a_long_prompt_is_split_and_only_its_last_chunk_samples() -> None:
    rig = create_rig(max_num_batched_tokens=64, long_prefill_token_threshold=32)
    (dec,) = create_requests(1, id_prefix="dec", prompt_len=4, max_tokens=10)
    rig.add(dec)
    rig.step()
    (long,) = create_requests(1, id_prefix="long", prompt_len=100, max_tokens=3)
    rig.add(long)
    seen = []
    for _ in range(4):
        plan, _ = rig.step()
        # The decode runs in every step of the long prefill.
        assert name(plan.seqs[0].seq_id) == "dec0" and len(plan.seqs[0].token_ids) == 1
        seen += [r for r in rows(plan) if r[0] == "long0"]
    assert seen == [
        ("long0", 0, 32, False),
        ("long0", 32, 32, False),
        ("long0", 64, 32, False),
        ("long0", 96, 4, True),
    ]
    rig.run()
    assert rig.worker.truth[sid("long0")][100:] == expected_tokens(long, 3)


def test_at_most_max_long_prefills_run_and_short_requests_pass_them() -> None:
    rig = create_rig(
        max_num_batched_tokens=64, long_prefill_token_threshold=16, max_long_prefills=1
    )
    long = create_requests(2, id_prefix="long", prompt_len=60, max_tokens=2)
    short = create_requests(2, id_prefix="short", prompt_len=8, max_tokens=2)
    rig.add(*long, *short)
    plan, events = rig.step()
    # long1 is skipped (one long prefill already runs), the short ones are not held behind it.
    assert [name(e.seq_id) for e in of_type(events, Scheduled)] == ["long0", "short0", "short1"]
    assert [(r[0], r[2]) for r in rows(plan)] == [("long0", 16), ("short0", 8), ("short1", 8)]
    started_long1 = None
    for step in range(1, 10):
        plan, events = rig.step()
        if "long1" in [name(e.seq_id) for e in of_type(events, Scheduled)]:
            started_long1 = step
            break
    # long0 needs 60 / 16 = 4 chunks: long1 starts in the step its last chunk is sent.
    assert started_long1 == 3
    assert rig.scheduler.long_prefills.total == 1
    rig.run()


def test_without_chunking_a_prompt_goes_in_one_step() -> None:
    rig = create_rig(
        enable_chunked_prefill=False, max_num_batched_tokens=256, long_prefill_token_threshold=16
    )
    rig.add(*create_requests(2, prompt_len=100, max_tokens=2))
    plan, _ = rig.step()
    assert [(r[2], r[3]) for r in rows(plan)] == [(100, True), (100, True)]
    rig.run()


def test_without_chunking_a_prompt_that_does_not_fit_the_budget_left_waits() -> None:
    rig = create_rig(enable_chunked_prefill=False, max_num_batched_tokens=256, num_kv_blocks=128)
    rig.add(*create_requests(3, prompt_len=100, max_tokens=2))
    plan, _ = rig.step()
    assert [r[2] for r in rows(plan)] == [100, 100]
    plan, _ = rig.step()
    assert [r[2] for r in rows(plan)] == [1, 1, 100]


def test_chunking_protects_short_requests_from_a_long_prompt() -> None:
    def short_ttfts(**overrides) -> list[float]:
        sim = create_simulation(max_model_len=2048, num_kv_blocks=1024, **overrides)
        (long,) = create_requests(1, id_prefix="long", prompt_len=1500, max_tokens=2)
        sim.submit(long, at=0.0)
        for i, request in enumerate(create_requests(20, id_prefix="s", max_tokens=4)):
            sim.submit(request, at=0.001 + i * 0.002)
        sim.run()
        return [r.ttft or 0.0 for r in sim.records.values() if name(r.request.seq_id) != "long0"]

    chunked = short_ttfts(max_num_batched_tokens=256, long_prefill_token_threshold=128)
    whole = short_ttfts(enable_chunked_prefill=False, max_num_batched_tokens=2048)
    # Unchunked, every short request waits for the 1500-token step (~40 ms); chunked, the
    # long prompt's steps stay short.
    assert max(whole) > 0.03
    assert max(chunked) < max(whole) / 3


def test_a_backlog_is_prefilled_in_larger_steps_until_it_is_worked_off() -> None:
    def new_tokens(backlog: int) -> list[int]:
        rig = create_rig(
            num_kv_blocks=128,
            max_num_batched_tokens=16,
            backlog_batched_tokens=backlog,
            long_prefill_token_threshold=32,
        )
        burst = create_requests(10, id_prefix=f"burst{backlog}-", prompt_len=8, max_tokens=3)
        rig.add(*burst)
        counts = []
        while True:
            plan, _ = rig.step()
            if plan.is_empty:
                break
            counts.append(sum(len(s.token_ids) for s in plan.seqs))
        for req in burst:
            assert rig.worker.truth[req.seq_id][8:] == expected_tokens(req, 3)
        assert rig.scheduler.stats().num_backlog_steps == (1 if backlog else 0)
        return counts

    # 80 prompt tokens wait: one step of 48 (six prompts), then 32 wait and steps are small again.
    backlog, off = new_tokens(48), new_tokens(0)
    assert backlog[0] == 48 and max(backlog[1:]) == 16
    assert off[0] == 16 and max(off) == 16
    assert sum(backlog) == sum(off) and len(backlog) < len(off)

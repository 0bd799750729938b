"""The start-up warm-up (engine/warm_up.py) runs every kind of step and leaves no trace."""

from __future__ import annotations

import torch

from engine.batch import SeqInput
from engine.engine import Engine
from engine.warm_up import representative_batches, warm_up_batches


def greedy(engine: Engine, prompt: list[int], steps: int) -> list[tuple[int, float]]:
    table = list(range(8))  # the blocks the warm-up wrote into
    out = engine.step([SeqInput("s", prompt, 0, table)])[0]
    got = [(out.token_id, out.logprob)]
    for i in range(steps):
        out = engine.step([SeqInput("s", [got[-1][0]], len(prompt) + i, table)])[0]
        got.append((out.token_id, out.logprob))
    engine.release(["s"])
    return got


def test_a_warmed_up_engine_answers_as_a_fresh_one(tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    from tests.engine.conftest import write_tiny_checkpoint

    folder = tmp_path_factory.mktemp("warm")
    write_tiny_checkpoint(folder, seed=3)
    fresh = Engine.from_path(folder, kv_cache_bytes=4 << 20, block_size=4, progress=False)
    warmed = Engine(fresh.loaded, fresh.num_kv_blocks, fresh.block_size, max_num_seqs=16)
    warmed.warm_up(max_step_tokens=64)
    assert warmed.start_times["warm_up"] > 0
    prompt = torch.randint(
        0, fresh.config.vocab_size, (13,), generator=torch.Generator().manual_seed(4)
    )
    assert greedy(warmed, prompt.tolist(), 6) == greedy(fresh, prompt.tolist(), 6)


def test_the_batches_cover_each_kernel_variant_and_fit_the_pool(tiny_engine: Engine) -> None:
    c, bs = tiny_engine.config, tiny_engine.block_size
    sizes = representative_batches(256, lambda b: 4 if b <= 8 else (16 if b <= 64 else 32))
    assert sizes == [8, 64, 256]
    batches = warm_up_batches(c, bs, num_blocks=40, decode_sizes=sizes, graph_sizes=[1, 2, 4],
                              max_step_tokens=2048, max_num_seqs=256)  # fmt: skip
    decode_groups = sorted(
        sum(len(s.token_ids) == 1 and s.start_pos > 0 for s in b)
        for b in batches
        if any(len(s.token_ids) > 1 for s in b)
    )
    assert decode_groups[-3:] == [8, 64, 256]  # each variant of the attention, beside prefills
    for batch in batches:
        for seq in batch:  # a pool of 40 blocks of 4 holds them all
            assert max(seq.block_table) < 40
            assert len(seq.block_table) * bs >= seq.start_pos + len(seq.token_ids)
            assert seq.start_pos + len(seq.token_ids) <= c.max_seq_len
    one = warm_up_batches(c, bs, 40, [1], [1], 2048, max_num_seqs=1)
    assert max(sum(len(s.token_ids) == 1 and s.start_pos > 0 for s in b) for b in one) == 1

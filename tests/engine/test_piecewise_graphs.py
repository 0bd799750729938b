"""Piecewise graphs' pieces, run eagerly on the CPU, give what the model's forward gives: the
split around attention loses nothing, and padding rows change no real row and write K/V only
into the dummy block. (tests/gpu/test_cuda.py replays the captured graphs against eager steps.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.batch import SeqInput
from engine.engine import Engine
from engine.piecewise_graphs import PiecewiseGraphs
from tests.engine.conftest import write_tiny_checkpoint


def steps(vocab: int) -> list[list[SeqInput]]:
    """Whole prompts; then a decode, a chunk continuing a prompt and a new prompt together; then
    a step longer than every bucket (eager)."""
    gen = torch.Generator().manual_seed(4)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    tables = [list(range(i * 30, i * 30 + 30)) for i in range(4)]
    return [
        [SeqInput("a", ids(7), 0, tables[0]), SeqInput("b", ids(10), 0, tables[1])],
        [
            SeqInput("a", ids(1), 7, tables[0]),
            SeqInput("b", ids(5), 10, tables[1]),
            SeqInput("c", ids(3), 0, tables[2]),
        ],
        [SeqInput("a", ids(1), 8, tables[0]), SeqInput("d", ids(70), 0, tables[3])],
    ]


def run(engine: Engine, pieces: PiecewiseGraphs | None) -> tuple[list[torch.Tensor], torch.Tensor]:
    engine.kv.pool.zero_()
    engine.piecewise = pieces
    hidden = [engine.forward(batch) for batch in steps(engine.config.vocab_size)]
    return hidden, engine.kv.pool.clone()


@pytest.mark.parametrize("buckets", [(16, 64), (32,)])
def test_pieces_around_attention_equal_the_forward(
    tmp_path: Path, buckets: tuple[int, ...]
) -> None:
    write_tiny_checkpoint(tmp_path, seed=3)
    engine = Engine.from_path(tmp_path, kv_cache_bytes=4 << 20, block_size=4, progress=False)
    dummy = engine.num_kv_blocks - 1  # no sequence here reaches it
    pieces = PiecewiseGraphs(engine.model, engine.kv, dummy, buckets, capture=False)
    with torch.inference_mode():
        want, want_pool = run(engine, None)
        got, got_pool = run(engine, pieces)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    slots = engine.block_size
    dummy_slots = slice(dummy * slots, (dummy + 1) * slots)
    outside = torch.ones(want_pool.shape[1], dtype=torch.bool)
    outside[dummy_slots] = False
    assert torch.allclose(got_pool[:, outside], want_pool[:, outside], rtol=1e-5, atol=1e-6)
    assert bool(got_pool[:, dummy_slots].abs().sum() > 0)  # the padding rows' K/V went there
    # The static buffers are not what forward returns: a later step leaves an earlier result be.
    with torch.inference_mode():
        first = engine.forward(steps(engine.config.vocab_size)[0])
        kept = first.clone()
        engine.forward(steps(engine.config.vocab_size)[1])
    assert torch.equal(first, kept)


def test_a_step_longer_than_every_bucket_is_refused_by_the_pieces(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, seed=3)
    engine = Engine.from_path(tmp_path, kv_cache_bytes=4 << 20, block_size=4, progress=False)
    pieces = PiecewiseGraphs(engine.model, engine.kv, 0, (16,), capture=False)
    tokens = torch.zeros(17, dtype=torch.int64)
    with pytest.raises(ValueError, match="17 tokens"):
        pieces.run(tokens, tokens, None)  # type: ignore[arg-type]

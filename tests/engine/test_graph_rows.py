"""The host side of a decode graph's step (engine/cuda_graphs.py): the static input rows it
fills, checked on the CPU against the rows written out one by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.batch import SeqInput
from engine.cuda_graphs import _CTX, _POS, _SLOT, _TABLE, _TOKEN, DecodeGraphs, GraphOutputs
from engine.errors import InvalidRequest

BS, DUMMY, BIGGEST, WIDTH = 4, 100, 8, _TABLE + 12


class _Event:
    def record(self) -> None: ...

    def synchronize(self) -> None: ...


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> DecodeGraphs:
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    g = DecodeGraphs.__new__(DecodeGraphs)
    g.block_size, g.dummy_block, g.buckets = BS, DUMMY, [2, 4, 8]
    g.rows = torch.zeros((BIGGEST, WIDTH), dtype=torch.int64)
    g.hosts = [torch.zeros((BIGGEST, WIDTH), dtype=torch.int64) for _ in "ab"]
    g._tables = [[None] * BIGGEST for _ in "ab"]
    g._copied, g._turn = [None, None], 0
    out = GraphOutputs(torch.zeros(BIGGEST, 5), torch.zeros(BIGGEST, dtype=torch.int64),
                       torch.zeros(BIGGEST, 2))  # fmt: skip
    g.graphs = {size: (None, out) for size in g.buckets}  # type: ignore[misc]
    for turn in range(2):
        g._fill_padding(turn, 0, BIGGEST)
    return g


def expected(batch: list[SeqInput], size: int) -> torch.Tensor:
    rows = torch.zeros((size, WIDTH), dtype=torch.int64)
    for i, seq in enumerate(batch):
        pos, table = seq.start_pos, seq.block_table
        rows[i, _TOKEN], rows[i, _POS], rows[i, _CTX] = seq.token_ids[0], pos, pos + 1
        rows[i, _SLOT] = table[pos // BS] * BS + pos % BS
        rows[i, _TABLE : _TABLE + len(table)] = torch.tensor(table)
    rows[len(batch) :, _SLOT] = DUMMY * BS
    rows[len(batch) :, _CTX] = 1
    rows[len(batch) :, _TABLE] = DUMMY
    return rows


def load(graphs: DecodeGraphs, batch: list[SeqInput]) -> torch.Tensor:
    tokens = np.array([s.token_ids[0] for s in batch])
    positions = np.array([s.start_pos for s in batch])
    size, _ = graphs._load(batch, tokens, positions)
    return graphs.rows[:size].clone()


def used(rows: torch.Tensor, batch: list[SeqInput]) -> torch.Tensor:
    """The rows without the table entries past each sequence's own (never read)."""
    rows = rows.clone()
    for i, seq in enumerate(batch):
        rows[i, _TABLE + len(seq.block_table) :] = 0
    return rows


def test_rows_follow_tables_that_grow_move_and_shrink(graphs: DecodeGraphs) -> None:
    a = SeqInput("a", [5], 7, (3, 9))
    b = SeqInput("b", [6], 2, [11])
    steps = [
        [a, b],
        [SeqInput("a", [8], 8, (3, 9, 40)), b],  # a opens a block
        [SeqInput("a", [8], 8, (3, 9, 40)), SeqInput("b", [1], 3, [11])],  # same tables
        [SeqInput("b", [2], 4, [11, 12]), SeqInput("c", [3], 1, (50,))],  # rows change owner
        [
            SeqInput("c", [4], 2, [50]),
            SeqInput("d", [4], 20, list(range(60, 66))),
            SeqInput("e", [9], 5, (70, 71)),
        ],
        [SeqInput("c", [4], 3, [50])],
    ]
    for batch in steps * 2:  # both host buffers meet every step
        size = graphs.bucket(len(batch))
        assert size is not None
        assert torch.equal(used(load(graphs, batch), batch), expected(batch, size))


def test_a_block_outside_the_pool_is_refused(graphs: DecodeGraphs) -> None:
    with pytest.raises(InvalidRequest, match="block_table"):
        load(graphs, [SeqInput("a", [5], 1, (DUMMY,))])
    with pytest.raises(InvalidRequest, match="block_table"):
        load(graphs, [SeqInput("a", [5], 1, (-1, 2))])

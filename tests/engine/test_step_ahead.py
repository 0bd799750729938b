"""A step replayed ahead (engine/cuda_graphs.py) is used only for the very step it replayed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.batch import SeqInput
from engine.cuda_graphs import GraphOutputs, StepAhead

OUTPUTS = GraphOutputs(torch.zeros(1, 10), torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2))
AHEAD = StepAhead(["a"], [41], [[3, 7, 9]], OUTPUTS, tokens=[5])
ASKED = SeqInput("a", [5], 41, [3, 7, 9])


def test_the_replayed_step_matches() -> None:
    assert AHEAD.matches([ASKED])
    assert AHEAD.matches([dataclasses.replace(ASKED, block_table=(3, 7, 9))])  # any sequence
    # A block past the ones replayed (the scheduler's next one, handed out a step early).
    assert AHEAD.matches([dataclasses.replace(ASKED, block_table=[3, 7, 9, 12])])


@pytest.mark.parametrize(
    "change",
    [
        {"seq_id": "b"},
        {"token_ids": [6]},  # the caller sampled, or chose, another token
        {"token_ids": [5, 6]},
        {"start_pos": 42},
        {"block_table": [3, 7, 10]},  # blocks moved (a preemption and a new placement)
        {"block_table": [3, 7]},
    ],
)
def test_any_other_step_does_not(change: dict[str, object]) -> None:
    assert not AHEAD.matches([dataclasses.replace(ASKED, **change)])  # type: ignore[arg-type]


def test_a_batch_of_another_size_does_not() -> None:
    assert not AHEAD.matches([ASKED, dataclasses.replace(ASKED, seq_id="b")])
    assert not AHEAD.matches([])


def test_tokens_unknown_yet_match_nothing() -> None:
    assert not dataclasses.replace(AHEAD, tokens=[]).matches([ASKED])

"""Engine.submit/collect with FROM_LAST_STEP: a step queued before the one that samples its input
has been read gives what stepping one at a time with the tokens in hand gives."""

from __future__ import annotations

import pytest
import torch

from engine.batch import FROM_LAST_STEP, SeqInput, SeqOutput
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sampling_params import GREEDY, SamplingParams

SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=7)
PENALISED = SamplingParams(temperature=0.9, seed=3, repetition_penalty=1.3, presence_penalty=0.5)


def _prompts(engine: Engine) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    vocab = engine.config.vocab_size
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 3, 12)]


def _run(engine: Engine, params: list[SamplingParams], steps: int, ahead: bool) -> list[list[int]]:
    """Greedy/sampled tokens of three sequences: one step at a time, or each step submitted
    before the last one is collected (its decodes taking FROM_LAST_STEP)."""
    prompts = _prompts(engine)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    tokens: list[list[int]] = [[] for _ in prompts]

    def batch(k: int) -> list[SeqInput]:
        rows = []
        for i, (prompt, table) in enumerate(zip(prompts, tables, strict=True)):
            if k == 0:
                rows.append(SeqInput(f"s{i}-{ahead}", prompt, 0, table, params[i]))
            else:
                token = FROM_LAST_STEP if ahead else tokens[i][-1]
                pos = len(prompt) + k - 1
                rows.append(SeqInput(f"s{i}-{ahead}", [token], pos, table, params[i]))
        return rows

    def take(outputs: list[SeqOutput]) -> None:
        for out in outputs:
            tokens[int(str(out.seq_id)[1])].append(out.token_id)

    if not ahead:
        for k in range(steps):
            take(engine.step(batch(k)))
    else:
        pending = engine.submit(batch(0))
        for k in range(1, steps):
            queued = engine.submit(batch(k))
            take(engine.collect(pending))
            pending = queued
        take(engine.collect(pending))
    engine.release(f"s{i}-{ahead}" for i in range(3))
    return tokens


@pytest.mark.parametrize(
    "params",
    [[GREEDY] * 3, [SEEDED, GREEDY, SEEDED], [PENALISED, SEEDED, PENALISED]],
    ids=["greedy", "seeded", "penalties"],
)
def test_steps_queued_ahead_equal_steps_one_at_a_time(
    tiny_engine: Engine, params: list[SamplingParams]
) -> None:
    expected = _run(tiny_engine, params, 6, ahead=False)
    assert _run(tiny_engine, params, 6, ahead=True) == expected
    assert all(len(t) == 6 for t in expected)


def test_from_last_step_needs_a_step_that_sampled_the_sequence(tiny_engine: Engine) -> None:
    table = list(range(8))
    tiny_engine.step([SeqInput("a", [1, 2, 3], 0, table)])
    with pytest.raises(InvalidRequest, match="sequence b takes FROM_LAST_STEP"):
        tiny_engine.submit([SeqInput("b", [FROM_LAST_STEP], 3, list(range(8, 16)))])
    # A chunk that does not sample leaves nothing for the next step to take.
    tiny_engine.step([SeqInput("a", [4, 5], 3, table, sample=False)])
    with pytest.raises(InvalidRequest, match="sequence a takes FROM_LAST_STEP"):
        tiny_engine.submit([SeqInput("a", [FROM_LAST_STEP], 5, table)])
    tiny_engine.release(["a", "b"])

"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' log-softmax on the same
random weights, whatever the chunks a prompt is prefilled in and whatever else shares the step."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine import prompt_scores
from engine.batch import SeqInput
from engine.engine import Engine
from engine.prompt_scores import PromptLogprobs
from engine.sampling_params import SamplingParams
from tests.engine.test_hf_parity import reference_logits

SCORED = SamplingParams(temperature=0.0, prompt_logprobs=3)


def run(engine: Engine, batch: list[SeqInput]) -> list[PromptLogprobs]:
    submitted = engine.submit(batch)
    engine.collect(submitted)
    return [p.to_host() for p in submitted.prompt_scores]


def scored_in_chunks(engine: Engine, ids: list[int], cuts: list[int], table: list[int]):  # type: ignore[no-untyped-def]
    """The prompt prefilled chunk by chunk, each step shared with an unscored sequence."""
    bounds = [0, *cuts, len(ids)]
    results: list[PromptLogprobs] = []
    other = [7] * 9
    for a, b in itertools.pairwise(bounds):
        batch = [
            SeqInput("other", other, 0, [60, 61, 62], sample=True, prompt_len=len(other)),
            SeqInput("p", ids[a:b], a, table, SCORED, sample=b == len(ids), prompt_len=len(ids)),
        ]
        results += run(engine, batch)
        engine.release(["other"])
    engine.release(["p"])
    return results


@pytest.mark.parametrize("cuts", [[], [5], [1, 2, 20, 21]])
def test_prompt_logprobs_equal_transformers_log_softmax(tiny_pair, cuts, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    reference, engine = tiny_pair
    monkeypatch.setattr(prompt_scores, "ROWS_AT_ONCE", 7)  # chunks of logits, joined
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, engine.config.vocab_size, (40,), generator=gen).tolist()
    expected = torch.log_softmax(reference_logits(reference, ids), dim=-1)  # (40, V)
    results = scored_in_chunks(engine, ids, cuts, list(range(10)))
    assert [r.seq_id for r in results] == ["p"] * len(results)
    # Every token but the first, each once, in order, whatever the chunks.
    positions = [r.start + i for r in results for i in range(len(r.logprobs))]
    assert positions == list(range(1, len(ids)))
    ours = torch.tensor([lp for r in results for lp in r.logprobs])
    want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(ours, want, atol=1e-4)
    ranks = [rank for r in results for rank in r.ranks]
    want_ranks = (expected[:-1] > want[:, None]).sum(dim=-1) + 1
    assert ranks == want_ranks.tolist()
    top = [t for r in results for t in r.top]
    values, top_ids = expected[:-1].topk(3, dim=-1)
    assert [[t for t, _ in row] for row in top] == top_ids.tolist()
    assert torch.allclose(torch.tensor([[lp for _, lp in row] for row in top]), values, atol=1e-4)


def test_a_chunk_without_the_row_before_it_scores_from_its_second_token(tiny_engine) -> None:  # type: ignore[no-untyped-def]
    ids = list(range(30, 50))
    # A prefix from the cache: the chunk starts at 8 and no row of position 7 was computed here.
    run(tiny_engine, [SeqInput("p", ids[:8], 0, [0, 1, 2, 3, 4])])  # unscored
    results = run(tiny_engine, [SeqInput("p", ids[8:], 8, [0, 1, 2, 3, 4], SCORED, True, 20)])
    tiny_engine.release(["p"])
    assert [(r.start, len(r.logprobs)) for r in results] == [(9, 11)]


def test_decode_rows_and_unscored_prompts_give_nothing(tiny_engine) -> None:  # type: ignore[no-untyped-def]
    ids = [5, 6, 7, 8]
    first = run(tiny_engine, [SeqInput("p", ids, 0, [0, 1], SCORED, True, 4)])
    assert [(r.start, len(r.logprobs), len(r.top[0])) for r in first] == [(1, 3, 3)]
    assert run(tiny_engine, [SeqInput("p", [9], 4, [0, 1], SCORED, True, 4)]) == []
    assert run(tiny_engine, [SeqInput("q", ids, 0, [2, 3], prompt_len=4)]) == []
    # Without alternatives asked for, each token still has its logprob and rank.
    plain = SamplingParams(prompt_logprobs=0)
    (only,) = run(tiny_engine, [SeqInput("r", ids, 0, [4, 5], plain, True, 4)])
    assert (len(only.logprobs), only.top) == (3, [[], [], []])
    tiny_engine.release(["p", "q", "r"])


def test_a_released_sequence_leaves_no_held_row(tiny_engine) -> None:  # type: ignore[no-untyped-def]
    ids = list(range(10, 30))
    run(tiny_engine, [SeqInput("p", ids[:6], 0, [0, 1, 2, 3, 4], SCORED, False, 20)])
    tiny_engine.release(["p"])
    # The same id again, as a new sequence whose chunk happens to start where the old one's
    # ended: the old row must not score it.
    results = run(tiny_engine, [SeqInput("p", ids[6:], 6, [0, 1, 2, 3, 4], SCORED, True, 20)])
    tiny_engine.release(["p"])
    assert results[0].start == 7


def test_scored_prompts_sharing_a_step_each_get_their_own(tiny_pair) -> None:  # type: ignore[no-untyped-def]
    reference, engine = tiny_pair
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(0, engine.config.vocab_size, (12,), generator=gen).tolist()
    b = torch.randint(0, engine.config.vocab_size, (9,), generator=gen).tolist()
    two = SamplingParams(temperature=0.0, prompt_logprobs=2)
    none = SamplingParams(temperature=0.0, prompt_logprobs=0)
    batch = [
        SeqInput("a", a, 0, [0, 1, 2], two, True, len(a)),
        SeqInput("x", [3, 4, 5], 0, [3], prompt_len=3),  # unscored, between them
        SeqInput("b", b, 0, [4, 5, 6], none, True, len(b)),
    ]
    got = {r.seq_id: r for r in run(engine, batch)}
    engine.release(["a", "x", "b"])
    assert set(got) == {"a", "b"}
    for name, ids, n in (("a", a, 2), ("b", b, 0)):
        expected = torch.log_softmax(reference_logits(reference, ids), dim=-1)[:-1]
        want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert got[name].start == 1
        assert torch.allclose(torch.tensor(got[name].logprobs), want, atol=1e-4)
        assert all(len(t) == n for t in got[name].top)

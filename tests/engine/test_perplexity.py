"""Perplexity (engine/perplexity.py) as llama-perplexity measures it, equal to the same measure
computed from transformers' logits on the same random weights."""

from __future__ import annotations

import math

import pytest
import torch

from engine.errors import InvalidRequest
from engine.perplexity import perplexity, windows
from tests.engine.test_hf_parity import reference_logits


def test_windows_are_whole_and_begin_with_bos() -> None:
    assert windows(list(range(10)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the tail dropped
    assert windows(list(range(10)), 4, 99) == [[99, 1, 2, 3], [99, 5, 6, 7]]
    assert windows(list(range(3)), 4, None) == []


@pytest.mark.parametrize("step_tokens", [16, 2048])  # one window a step, and all at once
def test_perplexity_equals_transformers(tiny_pair, step_tokens: int) -> None:  # type: ignore[no-untyped-def]
    reference, engine = tiny_pair
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, engine.config.vocab_size, (75,), generator=gen).tolist()
    ctx, bos = 16, 7
    got = perplexity(engine, ids, ctx, bos, step_tokens=step_tokens)
    nll = []
    for window in windows(ids, ctx, bos):
        logprobs = torch.log_softmax(reference_logits(reference, window), dim=-1)
        # Tokens ctx/2 + 1 .. ctx - 1, each scored from the row before it.
        nll += [-float(logprobs[p - 1, window[p]]) for p in range(ctx // 2 + 1, ctx)]
    assert (got.windows, got.tokens_scored) == (4, 4 * 7)
    assert got.nll == pytest.approx(nll, abs=1e-4)
    assert got.perplexity == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert 0 < got.error < got.perplexity


def test_perplexity_refuses_what_it_cannot_measure(tiny_engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequest, match="do not fill one window"):
        perplexity(tiny_engine, [1, 2, 3], 16, None)
    with pytest.raises(InvalidRequest, match="ctx: must be in"):
        perplexity(tiny_engine, list(range(1000)), 100_000, None)

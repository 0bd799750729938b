"""Each sampling parameter has its effect; seeded draws are reproducible and batch-independent."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.errors import InvalidRequest
from engine.sampling import Sampler, uniform_noise
from engine.sampling_params import SamplingParams


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def draw(params: SamplingParams, logits: torch.Tensor, n: int = 400, **history) -> Counter:  # type: ignore[no-untyped-def]
    """Tally n draws at n different positions (each position is an independent draw)."""
    sampler = Sampler()
    rows = logits.expand(n, -1)
    hist = [history.get("history")] * n
    out = sampler(rows, [params] * n, list(range(n)), hist)
    return Counter(out.token_ids.tolist())


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 2, [0, 0], [None, None])
    assert out.token_ids.tolist() == [1, 0]


def test_temperature_one_follows_the_distribution() -> None:
    counts = draw(SamplingParams(temperature=1.0, seed=7), logits_of([0.6, 0.3, 0.1]), n=3000)
    assert abs(counts[0] / 3000 - 0.6) < 0.05
    assert abs(counts[1] / 3000 - 0.3) < 0.05
    assert abs(counts[2] / 3000 - 0.1) < 0.04


def test_low_temperature_concentrates_on_the_mode() -> None:
    counts = draw(SamplingParams(temperature=0.1, seed=7), logits_of([0.5, 0.3, 0.2]))
    assert counts[0] >= 395


def test_top_k_keeps_only_the_k_most_likely() -> None:
    counts = draw(SamplingParams(top_k=2, seed=1), logits_of([0.4, 0.35, 0.25]))
    assert set(counts) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    assert set(draw(SamplingParams(top_p=0.5, seed=1), logits_of([0.6, 0.3, 0.1]))) == {0}
    assert set(draw(SamplingParams(top_p=0.8, seed=1), logits_of([0.6, 0.3, 0.1]))) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    counts = draw(SamplingParams(min_p=0.5, seed=1), logits_of([0.45, 0.3, 0.2, 0.05]))
    assert set(counts) == {0, 1}


def test_repetition_penalty_discourages_seen_tokens() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    plain = Sampler()(logits, [SamplingParams(temperature=0)], [3], [([0, 2], 1)])
    penalised = SamplingParams(temperature=0, repetition_penalty=1.5)
    out = Sampler()(logits, [penalised], [3], [([0, 2], 1)])
    assert plain.token_ids.item() == 0 and out.token_ids.item() == 1


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0]])
    params = SamplingParams(temperature=0, presence_penalty=1.0)
    # Token 0 only in the prompt (first 2 tokens): not penalised.
    assert Sampler()(logits, [params], [4], [([0, 0, 2, 1], 2)]).token_ids.item() == 0
    # Token 0 generated once: 2.0 - 1.0 < 1.5.
    assert Sampler()(logits, [params], [4], [([2, 1, 0], 2)]).token_ids.item() == 1
    freq = SamplingParams(temperature=0, frequency_penalty=0.3)
    # Generated twice: 2.0 - 0.6 < 1.5; once: 2.0 - 0.3 > 1.5.
    assert Sampler()(logits, [freq], [4], [([2, 0, 0], 1)]).token_ids.item() == 1
    assert Sampler()(logits, [freq], [4], [([2, 2, 0], 1)]).token_ids.item() == 0


def test_seeded_draws_are_reproducible_and_independent_of_the_batch() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(seed=42)
    alone = Sampler()(logits, [seeded], [17], [None]).token_ids.item()
    others = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    batch = torch.cat([others[:2], logits, others[2:]])
    params = [SamplingParams(), SamplingParams(seed=5), seeded, SamplingParams()]
    together = Sampler()(batch, params, [3, 9, 17, 1], [None] * 4).token_ids.tolist()
    assert together[2] == alone
    # A different seed or position gives an independent draw: not always the same token.
    draws = {
        Sampler()(logits, [SamplingParams(seed=s)], [17], [None]).token_ids.item()
        for s in range(20)
    }
    assert len(draws) > 1


def test_noise_is_uniform_and_deterministic() -> None:
    seeds, positions = torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0])
    u = uniform_noise(seeds, positions, 50_000)
    assert torch.equal(u, uniform_noise(seeds, positions, 50_000))
    assert bool(((u > 0) & (u < 1)).all())
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_logprobs_are_the_models_and_top_n_is_sorted() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = Sampler()(logits, [SamplingParams(temperature=0, logprobs=3)], [0], [None])
    expected = torch.log_softmax(logits, -1)[0]
    assert out.logprobs.item() == pytest.approx(expected[1].item())
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids[0].tolist() == [1, 2, 0]
    assert out.top_logprobs[0].tolist() == pytest.approx(expected[[1, 2, 0]].tolist())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("logprobs", 21),
        ("seed", -1),
    ],
)
def test_invalid_values_name_the_field(field: str, value: float) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


def test_too_many_logit_biases_are_counted_not_listed() -> None:
    bias = tuple((i, 1.0) for i in range(5000))
    with pytest.raises(InvalidRequest, match=r"logit_bias: must be at most 1024 ids, got 5000$"):
        SamplingParams(logit_bias=bias)

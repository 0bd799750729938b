"""logit_bias, allowed_token_ids and min_tokens in the sampler, and through the engine on the
default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.batch import SeqInput
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sampling import Sampler
from engine.sampling_params import SamplingParams


def test_logit_bias_moves_the_greedy_pick() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    biased = SamplingParams(temperature=0, logit_bias=((2, 5.0),))
    assert Sampler()(logits, [biased], [0], [None]).token_ids.tolist() == [2]
    banned = SamplingParams(temperature=0, logit_bias=((0, -100.0),))
    assert Sampler()(logits, [banned], [0], [None]).token_ids.tolist() == [1]


def test_logit_bias_leaves_reported_logprobs_the_models_own() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    out = Sampler()(logits, [SamplingParams(temperature=0, logit_bias=((2, 5.0),))], [0], [None])
    assert out.logprobs.item() == pytest.approx((1.0 - torch.logsumexp(logits[0], 0)).item())


def test_logit_bias_rows_are_independent() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0]] * 2)
    params = [SamplingParams(temperature=0, logit_bias=((1, 2.0),)), SamplingParams(temperature=0)]
    assert Sampler()(logits, params, [0, 0], [None, None]).token_ids.tolist() == [1, 0]


def test_logit_bias_beyond_the_vocabulary_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="logit_bias"):
        Sampler()(torch.zeros(1, 4), [SamplingParams(logit_bias=((4, 1.0),))], [0], [None])
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),))


def test_min_tokens_holds_back_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0]])  # token 0 plays end-of-sequence
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(0,))
    # Prompt of 10: positions 10 and 11 are the first two outputs, 12 the third.
    picks = [Sampler()(logits, [p], [pos], [None], [10]).token_ids.item() for pos in (10, 11, 12)]
    assert picks == [1, 1, 0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_only_allowed_tokens_are_sampled_at_their_own_odds(temperature: float) -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).repeat(200, 1)
    allowed = (3, 17, 40)
    params = [
        SamplingParams(temperature=temperature, seed=i, allowed_token_ids=allowed)
        for i in range(600)
    ]
    out = Sampler()(logits, params, [0] * 600, [None] * 600)
    picks = out.token_ids.tolist()
    assert set(picks) <= set(allowed)
    if temperature == 0:  # the best of the allowed ones, not the best of all
        best = [allowed[int(logits[i, list(allowed)].argmax())] for i in range(600)]
        assert picks == best
    else:  # each allowed one is drawn
        assert set(picks) == set(allowed)
    # The logprobs reported stay the model's own, as logit_bias leaves them.
    own = torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None].long())[:, 0]
    assert torch.allclose(out.logprobs, own, atol=1e-5)


def test_allowed_token_ids_are_checked_by_name() -> None:
    with pytest.raises(
        InvalidRequest, match="allowed_token_ids: must be at most 1024 ids, got 1025"
    ):
        SamplingParams(allowed_token_ids=tuple(range(1025)))
    with pytest.raises(InvalidRequest, match="allowed_token_ids: must be empty with an output"):
        SamplingParams(allowed_token_ids=(1,), grammar="x")
    with pytest.raises(InvalidRequest, match="allowed_token_ids: must be more than ids that end"):
        SamplingParams(allowed_token_ids=(1,), min_tokens=2, stop_token_ids=(1, 2))
    with pytest.raises(InvalidRequest, match="allowed_token_ids"):
        Sampler()(torch.zeros(1, 4), [SamplingParams(allowed_token_ids=(4,))], [0], [None])


def test_a_bad_word_is_never_completed() -> None:
    """A bad word's last token is masked where the output so far ends with the rest of it; a
    word of one token, always. The prompt does not count (the output is what is held)."""
    words = ((7,), (3, 4, 5))
    logits = torch.zeros(1, 10)
    logits[0, [7, 5, 4]] = torch.tensor([9.0, 8.0, 7.0])  # the model's favourites, in order
    p = SamplingParams(temperature=0, bad_words_ids=words)
    assert p.needs_history  # (a word of two tokens or more reads the output)

    def pick(tokens: list[int], prompt_len: int = 0) -> int:
        return int(Sampler()(logits, [p], [len(tokens)], [(tokens, prompt_len)]).token_ids)

    assert pick([]) == 5  # 7 is banned everywhere
    assert pick([3]) == 5  # 5 only after 3 4
    assert pick([3, 4]) == 4 and pick([1, 3, 4], prompt_len=1) == 4
    assert pick([3, 4], prompt_len=2) == 5  # 3 4 was the prompt's


def test_bad_words_are_checked_by_name() -> None:
    with pytest.raises(InvalidRequest, match="bad_words_ids: must be non-empty"):
        SamplingParams(bad_words_ids=((),))
    with pytest.raises(InvalidRequest, match="bad_words_ids: must be non-empty"):
        SamplingParams(bad_words_ids=(tuple(range(1025)),))
    with pytest.raises(InvalidRequest, match="bad_words_ids: must be empty with an output"):
        SamplingParams(bad_words_ids=((1,),), allowed_token_ids=(1, 2))


def test_plain_greedy_is_untouched() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 4, [1] * 4, [None] * 4, [0] * 4)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


@pytest.mark.slow
def test_engine_min_tokens_delays_the_end_of_a_chat_turn(default_gguf: Path) -> None:
    from engine.tokenizer import load_tokenizer

    engine = Engine.from_path(default_gguf, kv_cache_bytes=16 << 20, progress=False)
    tok = load_tokenizer(default_gguf)
    ids = tok.encode_chat([{"role": "user", "content": "What is 2+2? Answer with a number only."}])
    eos = tuple(sorted(tok.eos_token_ids))

    def run(params: SamplingParams, steps: int) -> list[int]:
        table = list(range(-(-(len(ids) + steps) // engine.block_size)))
        seq = SeqInput("s", ids, 0, table, params, prompt_len=len(ids))
        out: list[int] = []
        for i in range(steps):
            (o,) = engine.step([seq])
            out.append(o.token_id)
            if o.token_id in eos:
                break
            seq = SeqInput("s", [o.token_id], len(ids) + i, table, params, prompt_len=len(ids))
        engine.release(["s"])
        return out

    plain = run(SamplingParams(temperature=0), 120)
    assert plain[-1] in eos, "the reference turn should end by itself"
    held = run(
        SamplingParams(temperature=0, min_tokens=len(plain) + 3, stop_token_ids=eos), len(plain) + 8
    )
    assert len(held) >= len(plain) + 3
    assert not set(held[: len(plain) + 3]) & set(eos)
    assert held[: len(plain) - 1] == plain[:-1]  # the same text up to where it would have ended

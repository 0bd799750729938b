"""Sampling parameters cross from the scheduler to the worker whole: every field of one request
comes out of the hot path's message as it went in."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from services.protocol import sampling_from_pb, sampling_to_pb


def test_every_sampling_field_survives_the_wire() -> None:
    asked = SamplingParams(
        temperature=0.5, top_k=7, top_p=0.5, min_p=0.25, repetition_penalty=1.5,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=11, logprobs=3,
        logit_bias=((2, 1.5), (9, -100.0)), min_tokens=2, stop_token_ids=(0, 5),
        prompt_logprobs=1, allowed_token_ids=(1, 4, 8),
    )  # fmt: skip
    assert sampling_from_pb(sampling_to_pb(asked)) == asked
    # (bad words are not with allowed_token_ids)
    worded = SamplingParams(bad_words_ids=((3,), (5, 6, 7)), repetition_penalty=1.5)
    assert sampling_from_pb(sampling_to_pb(worded)) == worded
    plain = SamplingParams(stop_token_ids=(0,))  # without min_tokens they hold nothing back
    assert sampling_from_pb(sampling_to_pb(plain)) == SamplingParams()

"""Conversions between the engine's dataclasses and the internal protobuf records (the edge)."""

from __future__ import annotations

from engine.sampling import SamplingParams
from tandem.internal.v1 import hotpath_pb2 as hp


def sampling_to_pb(params: SamplingParams) -> hp.Sampling:
    msg = hp.Sampling(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logprobs=params.logprobs,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_pb(msg: hp.Sampling) -> SamplingParams:
    # float32 on the wire: round to what a float32 holds, so 0.9 stays within top_p's (0, 1].
    return SamplingParams(
        temperature=msg.temperature,
        top_p=min(msg.top_p, 1.0),
        top_k=msg.top_k,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs,
    )

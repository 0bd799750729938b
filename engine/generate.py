"""Offline generation of one sequence with the engine alone: the loop behind `tandem run`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from engine.batch import SeqInput
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from engine.stop_strings import StopStringMatcher
from engine.tokenizer import Detokenizer, Tokenizer


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()


@dataclass
class Delta:
    token_id: int
    text: str
    logprob: float


@dataclass
class Generation:
    """Fills in as it is iterated: the deltas stream out, the totals stay here."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""


def check_request(request: GenerationRequest, max_seq_len: int, vocab_size: int) -> None:
    prompt_len = len(request.prompt_ids)
    if prompt_len == 0:
        raise InvalidRequest("prompt", "is empty")
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest("prompt_ids", f"ids {bad[:5]} are outside [0, {vocab_size})")
    if prompt_len >= max_seq_len:
        raise InvalidRequest(
            "prompt", f"{prompt_len} tokens do not fit the model's context of {max_seq_len}"
        )
    if request.max_tokens <= 0:
        raise InvalidRequest("max_tokens", f"must be positive, got {request.max_tokens}")
    if prompt_len + request.max_tokens > max_seq_len:
        raise InvalidRequest(
            "max_tokens",
            f"{prompt_len} prompt tokens + {request.max_tokens} exceed the model's context "
            f"of {max_seq_len}; ask for at most {max_seq_len - prompt_len}",
        )


def generate(
    engine: Engine, tokenizer: Tokenizer, request: GenerationRequest, out: Generation
) -> Iterator[Delta]:
    check_request(request, engine.config.max_seq_len, engine.config.vocab_size)
    prompt_len = len(request.prompt_ids)
    blocks = -(-(prompt_len + request.max_tokens) // engine.block_size)
    if blocks > engine.num_kv_blocks:
        raise InvalidRequest(
            "max_tokens", f"needs {blocks} KV blocks, the cache holds {engine.num_kv_blocks}"
        )
    table = list(range(blocks))
    detok = Detokenizer(tokenizer, skip_special=True)
    stops = StopStringMatcher(request.stop_strings)
    seq = SeqInput("offline", request.prompt_ids, 0, table, request.sampling, prompt_len=prompt_len)
    try:
        while True:
            (sampled,) = engine.step([seq])
            out.token_ids.append(sampled.token_id)
            if sampled.token_id in request.stop_token_ids:
                out.finish_reason = "stop"
                text = stops.flush() + detok.flush()
            else:
                text = stops.feed(detok.feed(sampled.token_id))
                if stops.stopped:
                    out.finish_reason = "stop"
                elif len(out.token_ids) == request.max_tokens:
                    out.finish_reason = "length"
                    text += stops.feed(detok.flush()) + stops.flush()
            out.text += text
            yield Delta(sampled.token_id, text, sampled.logprob)
            if out.finish_reason:
                return
            position = prompt_len + len(out.token_ids) - 1
            seq = replace(seq, token_ids=[sampled.token_id], start_pos=position)
    finally:
        engine.release(["offline"])

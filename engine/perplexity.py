"""A text's perplexity under the model, measured as llama.cpp's `llama-perplexity` measures it,
so the two can be compared on the same GGUF: the tokens are cut into windows of `ctx`; each
window begins with BOS where the model's prompts do (in place of its first token); the tokens of
the second half of each window are scored, each given every token before it in the window (so
each has at least ctx/2 of context); the perplexity is exp of their mean negative logprob.

Windows are prefilled whole, as many at once as a step's token budget and the KV cache hold,
and scored from the prefill's own hidden states (SamplingParams.prompt_logprobs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from engine.batch import SeqInput
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams

SCORED = SamplingParams(temperature=0.0, prompt_logprobs=0)


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    # The standard error of the mean negative logprob, carried to the perplexity (first order),
    # as llama-perplexity prints it after "±".
    error: float
    windows: int
    tokens_scored: int
    nll: list[float]  # each scored token's negative logprob, window by window


def windows(ids: Sequence[int], ctx: int, bos: int | None) -> list[list[int]]:
    """The whole windows of `ctx` tokens (a shorter tail is dropped, as llama-perplexity does),
    each beginning with `bos` when given."""
    out = []
    for start in range(0, len(ids) - ctx + 1, ctx):
        window = list(ids[start : start + ctx])
        if bos is not None:
            window[0] = bos
        out.append(window)
    return out


def perplexity(
    engine: Engine,
    ids: Sequence[int],
    ctx: int,
    bos: int | None,
    step_tokens: int = 2048,
    progress: Callable[[int, float], None] | None = None,
) -> Perplexity:
    """progress: called after each step with the windows it finished and the perplexity so far
    (llama-perplexity prints that running estimate too)."""
    if ctx < 4 or ctx > engine.config.max_seq_len:
        raise InvalidRequest("ctx", f"must be in [4, {engine.config.max_seq_len}], got {ctx}")
    chunks = windows(ids, ctx, bos)
    if not chunks:
        raise InvalidRequest("text", f"{len(ids)} tokens do not fill one window of {ctx}")
    blocks_per = -(-ctx // engine.block_size)
    at_once = max(
        1, min(step_tokens // ctx, engine.num_kv_blocks // blocks_per, engine.max_num_seqs)
    )
    if blocks_per > engine.num_kv_blocks:
        raise InvalidRequest("ctx", f"a window of {ctx} tokens does not fit the KV cache")
    nll: list[float] = []
    for group in _groups(len(chunks), at_once):
        batch = [
            SeqInput(
                seq_id=w,
                token_ids=chunks[w],
                start_pos=0,
                block_table=list(range(i * blocks_per, (i + 1) * blocks_per)),
                sampling=SCORED,
                prompt_len=ctx,
            )
            for i, w in enumerate(group)
        ]
        submitted = engine.submit(batch)
        engine.collect(submitted)
        engine.release(group)
        by_window = {s.seq_id: s.to_host() for s in submitted.prompt_scores}
        for w in group:
            scores = by_window[w]
            # Position p's token is scored from p - 1; llama-perplexity's first scored row is
            # ctx // 2, so its first token is ctx // 2 + 1, its last the window's last.
            first = ctx // 2 + 1
            nll += [-lp for lp in scores.logprobs[first - scores.start :]]
        if progress is not None:
            progress(len(group), math.exp(math.fsum(nll) / len(nll)))
    mean = math.fsum(nll) / len(nll)
    variance = math.fsum((x - mean) ** 2 for x in nll) / max(1, len(nll) - 1)
    ppl = math.exp(mean)
    return Perplexity(ppl, ppl * math.sqrt(variance / len(nll)), len(chunks), len(nll), nll)


def _groups(count: int, size: int) -> Iterator[list[int]]:
    for start in range(0, count, size):
        yield list(range(start, min(start + size, count)))

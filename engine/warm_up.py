"""The steps an engine runs once at start, so that no request pays for a cold path.

The first time a process meets a kind of step it pays for more than the step: Triton compiles a
kernel for each new specialisation (a constexpr such as the attention's partition length, which
follows the batch size, or an integer argument that is 1 or a multiple of 16), autotuning times
its configurations per shape, torch loads each kernel's module on first use, cuBLAS picks its
kernels per shape, and the caching allocator grows to the largest step's activations. Decode
steps of every batch bucket are captured as CUDA graphs before this (engine/cuda_graphs.py);
these batches cover the rest: prompts of every size class, prefill chunks that continue a
prompt, steps that mix them with decodes of every batch-size class of the eager attention
kernel, the sampler's paths, and one-sequence decoding with its step replayed ahead.

Every sequence here shares one block table over the first blocks of the pool, which no
sequence holds yet: what they write is overwritten before anything reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from engine.batch import SeqInput
from engine.config import ModelConfig
from engine.sampling_params import GREEDY, SamplingParams

# Token counts of one step's rows whose kernels specialise differently: 1, multiples of 16 and
# others, on both sides of the int8 kernel's 16/32/64-row tiles, and the step budget itself.
_PROMPT_SIZES = (1, 2, 16, 17, 24, 32, 48, 50, 64, 65, 128, 500)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=1, logprobs=5)
PENALISED = SamplingParams(temperature=0.7, repetition_penalty=1.1, presence_penalty=0.5)


def representative_batches(max_num_seqs: int, variant: Callable[[int], Hashable]) -> list[int]:
    """The largest batch size of each variant `variant(b)` of a kernel over 1..max_num_seqs."""
    largest = {variant(b): b for b in range(1, max_num_seqs + 1)}  # the last b of each
    return sorted(largest.values())


def warm_up_batches(
    config: ModelConfig,
    block_size: int,
    num_blocks: int,
    decode_sizes: list[int],
    graph_sizes: list[int],
    max_step_tokens: int,
    max_num_seqs: int,
) -> list[list[SeqInput]]:
    """The batches to step through, in order. decode_sizes: decode rows to mix with prefills
    (one per variant of the eager attention kernel); graph_sizes: decode-only batches, which
    CUDA graphs serve (empty without graphs); no step decodes more than max_num_seqs rows."""
    longest = max(2, min(max_step_tokens, config.max_seq_len - 1, num_blocks * block_size - 1))
    table = list(range(-(-(longest + 1) // block_size)))
    vocab = config.vocab_size

    def ids(n: int, salt: int) -> list[int]:
        return [(salt * 7919 + i * 104729) % vocab for i in range(n)]

    batches = [
        [SeqInput(f"warm-p{n}", ids(n, n), 0, table)]
        for n in sorted({*(s for s in _PROMPT_SIZES if s < longest), longest})
    ]
    # Mixed steps: a chunk that continues a prompt (its keys partly in the pool), a whole short
    # prompt, and decodes; the chunk is not the prompt's last, so it does not sample.
    chunk_start = longest // 2
    for b in decode_sizes:
        chunk = max(1, min(longest - chunk_start, max_step_tokens - b - 8))
        batch = [
            SeqInput("warm-c", ids(chunk, 3), chunk_start, table, sample=False),
            SeqInput("warm-s", ids(8, 5), 0, table),
        ]
        batch += [SeqInput(f"warm-d{i}", [i % vocab], chunk_start, table) for i in range(b)]
        batches.append(batch)
    # Decode-only steps: greedy (on CUDA, picked inside each bucket's graph: its first replay
    # uploads it), then sampled and penalised (the sampler's paths).
    pos = min(longest - 1, 4 * block_size + 1)
    for n in graph_sizes:
        batches.append([SeqInput(f"warm-g{i}", [i % vocab], pos, table) for i in range(n)])
    penalised = SeqInput(
        "warm-pen", [2], pos, table, PENALISED, prompt_len=pos // 2, prefix_ids=ids(pos, 9)
    )
    sampled = [SeqInput("warm-r0", [1], pos, table, SAMPLED), penalised]
    sampled.append(SeqInput("warm-r1", [3], pos, table, SAMPLED))
    batches.append(sampled[:max_num_seqs])
    # One sequence decoding, its next step replayed ahead (and never asked for: another token).
    start = max(1, longest - 3 - (longest % block_size))
    batches.append([SeqInput("warm-one", ids(start, 11), 0, table)])
    batches += [[SeqInput("warm-one", [7], start + i, table, GREEDY)] for i in range(3)]
    return batches

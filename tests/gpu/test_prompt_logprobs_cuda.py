"""Prompt logprobs on CUDA (bf16, graphs on): a scored prompt's rows leave the graphs for the
eager path, in chunks and beside a decode, and its scores agree with the fp32 engine on the
CPU. Marked `gpu`."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine
from engine.prompt_scores import PromptLogprobs
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.gpu

SCORED = SamplingParams(temperature=0, prompt_logprobs=2)


def scores(engine: Engine, ids: list[int], cuts: list[int]) -> list[PromptLogprobs]:
    """The prompt prefilled in chunks, each step beside a one-token decode of another."""
    bounds = [0, *cuts, len(ids)]
    table = list(range(-(-len(ids) // engine.block_size)))
    other = list(range(len(table), len(table) + 2))
    out: list[PromptLogprobs] = []
    engine.step([SeqInput("other", [5, 6, 7], 0, other, prompt_len=3)])
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        batch = [
            SeqInput("other", [8], 3 + i, other, prompt_len=3),
            SeqInput("p", ids[a:b], a, table, SCORED, b == len(ids), len(ids)),
        ]
        submitted = engine.submit(batch)
        engine.collect(submitted)
        out += [s.to_host() for s in submitted.prompt_scores]
    engine.release(["p", "other"])
    return out


def test_prompt_logprobs_on_cuda_agree_with_the_cpu(tandem_home: Path) -> None:
    model = registry.resolve(registry.DEFAULT_MODEL, tandem_home)
    ids = load_tokenizer(model).encode_prompt("The quick brown fox " * 12, allow_special=False)
    cuda = Engine.from_path(model, "cuda", "bfloat16", 64 << 20, progress=False, max_num_seqs=8)
    assert cuda.graphs is not None and cuda.piecewise is not None
    cpu = Engine.from_path(model, kv_cache_bytes=64 << 20, progress=False, quantize="none")
    # One token chunks too: rows a decode graph would take, were they not scored.
    cuts = [1, 2, 17, len(ids) - 1]
    got, whole, want = scores(cuda, ids, cuts), scores(cuda, ids, []), scores(cpu, ids, [])
    positions = [r.start + i for r in got for i in range(len(r.logprobs))]
    assert positions == list(range(1, len(ids)))
    ours, once, reference = (
        torch.tensor([lp for r in rows for lp in r.logprobs]) for rows in (got, whole, want)
    )
    # The same bf16 numbers, whether the prompt came in one chunk or in five beside a decode:
    # only the matmuls' shapes differ.
    chunking = (ours - once).abs()
    # Against fp32: bf16 keeps 8 bits of a logit, so a logprob of -14 moves by a tenth; a row
    # taken from the wrong place is off by whole units.
    dtype = (ours - reference).abs()
    print(f"chunked vs whole (cuda): max {chunking.max():.4f} mean {chunking.mean():.4f}")
    print(f"cuda bf16 vs cpu fp32: max {dtype.max():.4f} mean {dtype.mean():.4f}")
    assert chunking.max() < 0.1
    assert dtype.max() < 0.4 and dtype.mean() < 0.05
    top1 = [t[0][0] for r in got for t in r.top]
    assert sum(
        a == b for a, b in zip(top1, [t[0][0] for r in want for t in r.top], strict=True)
    ) >= 0.9 * len(top1)

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
    got, want = scores(cuda, ids, cuts), scores(cpu, ids, [])
    positions = [r.start + i for r in got for i in range(len(r.logprobs))]
    assert positions == list(range(1, len(ids)))
    ours = torch.tensor([lp for r in got for lp in r.logprobs])
    reference = torch.tensor([lp for r in want for lp in r.logprobs])
    assert (ours - reference).abs().max() < 0.15  # bf16 weights and activations
    top1 = [t[0][0] for r in got for t in r.top]
    assert sum(
        a == b for a, b in zip(top1, [t[0][0] for r in want for t in r.top], strict=True)
    ) >= 0.9 * len(top1)

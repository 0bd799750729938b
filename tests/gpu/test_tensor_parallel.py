"""Tensor parallelism on GPUs, one a rank, over NCCL: the decode steps' CUDA graphs capture the
collectives, the logits agree with one GPU's, and a dead rank fails the group. Marked `gpu`,
and skipped where fewer than two GPUs are visible."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from engine.batch import SeqInput
from engine.errors import RankGroupError
from engine.rank_group import EngineArgs, start_engine
from engine.registry import SEED_KEY
from engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]
TOP5 = SamplingParams(logprobs=5)


def random_model(folder: Path) -> Path:
    """GQA 8/4 with head_dim 128 (the kernels' tiles), a small vocabulary, random weights."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2000,
        "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, SEED_KEY: 3, "_name_or_path": "tp-gpu",
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def args_for(path: Path) -> EngineArgs:
    return EngineArgs(path, "cuda", "bfloat16", 64 << 20, progress=False, max_num_seqs=8)


def decode(engine: object, tokens: list[int] | None, steps: int) -> list[dict[int, float]]:
    """Each step's top-5 {token: logprob}, fed `tokens` (teacher forcing) or its own picks."""
    step = engine.step  # type: ignore[attr-defined]
    prompt, table, fed = [5, 17, 300, 42, 999, 7], list(range(8)), []
    out = step([SeqInput("s", prompt, 0, table, TOP5)])[0]
    tops = [dict(out.top_logprobs)]
    fed.append(out.token_id if tokens is None else tokens[0])
    for i in range(steps - 1):
        out = step([SeqInput("s", [fed[-1]], len(prompt) + i, table, TOP5)])[0]
        tops.append(dict(out.top_logprobs))
        fed.append(out.token_id if tokens is None else tokens[i + 1])
    return tops


def test_two_gpus_score_as_one(tmp_path: Path) -> None:
    path = random_model(tmp_path / "model")
    one = start_engine(args_for(path), 1)
    want = decode(one, None, 24)
    picks = [max(top, key=top.__getitem__) for top in want]
    del one
    group = start_engine(args_for(path), 2)
    try:
        assert group.graphs is not None  # decode steps through captured graphs, NCCL inside
        got = decode(group, picks, 24)
    finally:
        group.close()
    # bf16 sums in another order: one GPU's pick among the group's top 5, near-equal logprobs.
    for pick, mine in zip(picks, got, strict=True):
        assert pick in mine
    for pick, mine, theirs in zip(picks, got, want, strict=True):
        assert abs(mine[pick] - theirs[pick]) < 0.05


def test_a_dead_gpu_rank_fails_the_group(tmp_path: Path) -> None:
    group = start_engine(args_for(random_model(tmp_path / "model")), 2)
    try:
        decode(group, None, 4)
        os.kill(group.followers.followers[0].pid, signal.SIGKILL)  # type: ignore[union-attr]
        # Raised, not hung until a collective's timeout (pytest's timeout would end a hang).
        with pytest.raises(RankGroupError, match="killed by SIGKILL"):
            decode(group, None, 4)
    finally:
        group.close()

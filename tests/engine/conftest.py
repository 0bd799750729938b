"""Tiny random LLaMA checkpoints written by transformers itself, and engines over them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import Engine

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)

VARIANTS = {
    "gqa-untied": dict(tie_word_embeddings=False),
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope": dict(
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
}


def write_tiny_checkpoint(folder: Path, seed: int = 0, **overrides: object):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Norm weights start at one; perturb them so a misplaced norm cannot go unnoticed.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="session", params=sorted(VARIANTS))
def tiny_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(transformers model, our engine) on the same random weights, for each config variant."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = write_tiny_checkpoint(folder, **VARIANTS[request.param])
    engine = Engine.from_path(folder, kv_cache_bytes=4 << 20, block_size=4, progress=False)
    return reference, engine


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(folder, seed=1)
    return Engine.from_path(folder, kv_cache_bytes=4 << 20, block_size=4, progress=False)

"""Seeded random weights of a real model's shapes, for exercising big models we cannot download.

A random model is a folder holding a `config.json` (Hugging Face keys, plus `tandem_random_seed`)
and a tokenizer; its weights are drawn on the target device when loaded. Each tensor comes from
its own generator seeded by (seed, name), so any two loads — ours and a transformers model built
for comparison — get bit-identical weights.
"""

from __future__ import annotations

import itertools
import zlib

import torch

from engine.config import ModelConfig
from engine.weights import NORMS, PROJECTIONS

_STD = 0.02  # the initializer range LLaMA checkpoints are trained from


class RandomWeights:
    """A weight reader (loader.py wraps it) drawing each HF-named tensor on demand."""

    def __init__(
        self, config: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config, self.seed, self.device, self.dtype = config, seed, device, dtype

    def shape(self, name: str) -> tuple[int, ...]:
        c = self.config
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (c.vocab_size, c.dim)
        if name.endswith("norm.weight"):
            return (c.dim,)
        part = name.split(".")[-2]
        return {
            "q_proj": (c.q_dim, c.dim),
            "k_proj": (c.kv_dim, c.dim),
            "v_proj": (c.kv_dim, c.dim),
            "o_proj": (c.dim, c.q_dim),
            "gate_proj": (c.ffn_dim, c.dim),
            "up_proj": (c.ffn_dim, c.dim),
            "down_proj": (c.dim, c.ffn_dim),
        }[part]

    def names(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_embeddings:
            names.append("lm_head.weight")
        parts = [*itertools.chain(*PROJECTIONS.values()), *NORMS.values()]
        layers = range(self.config.n_layers)
        return names + [f"model.layers.{i}.{part}.weight" for i in layers for part in parts]

    def has(self, name: str) -> bool:
        return name != "lm_head.weight" or not self.config.tie_embeddings

    def get(self, name: str) -> torch.Tensor:
        gen = torch.Generator(device=self.device)
        gen.manual_seed((self.seed << 32) ^ zlib.crc32(name.encode()))
        out = torch.randn(self.shape(name), generator=gen, device=self.device)
        out = 1.0 + 0.1 * out if name.endswith("norm.weight") else _STD * out
        return out.to(self.dtype)

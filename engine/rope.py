"""Rotary position embeddings in the Hugging Face layout (rotate-half), with LLaMA-3 scaling."""

from __future__ import annotations

import math

import torch

from engine.config import RopeScaling


def inverse_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies, scaled as LLaMA-3.1 does for long context."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:
        # GGUF files carry LLaMA-3 scaling as per-frequency divisors (llama.cpp's rope_freqs).
        return inv_freq / freq_factors.float()
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (tokens, heads, head_dim); cos/sin: (tokens, head_dim) for each token's position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]

"""The LLaMA forward pass over a paged KV cache, in the shape of gpt-fast.

Transformer → TransformerBlock → Attention / FeedForward / RMSNorm. The step's tokens of all
sequences are flattened into one row of T tokens; attention finds each sequence's keys through
the metadata built once per step (engine/attention.py). Q/K/V and gate/up projections are fused
into one matmul each. Weights are attached by the loader; nothing here knows file formats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.rope import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused op
        # Normalise in fp32 whatever the weights' dtype, as the reference implementation does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wqkv = nn.Linear(config.dim, config.q_dim + 2 * config.kv_dim, bias=False)
        self.wo = nn.Linear(config.q_dim, config.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        heads = self.n_heads + 2 * self.n_kv_heads
        qkv = self.wqkv(x).view(t, heads, hd)  # (T, n_heads + 2 n_kv, hd)
        rope_heads = self.n_heads + self.n_kv_heads
        qk = apply_rope(qkv[:, :rope_heads], cos, sin)  # Q and K rotated together
        q = qk[:, : self.n_heads]  # (T, n_heads, hd)
        kv = torch.cat([qk[:, self.n_heads :], qkv[:, rope_heads:]], dim=1)  # (T, 2 n_kv, hd)
        out = paged_attention(q, kv.view(t, 2, self.n_kv_heads, hd), kv_pool, meta)
        return self.wo(out.reshape(t, self.n_heads * hd))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, kv_pool, meta)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    inv_freq: torch.Tensor  # (head_dim // 2,) RoPE inverse frequencies, set by the loader

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.rms_norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2), persistent=False)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache
    ) -> torch.Tensor:
        """tokens, positions: (T,). Returns the final-normed hidden states (T, dim)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, hd / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        x = self.tok_embeddings(tokens)  # (T, dim)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv.layer(i), meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, dim) → (N, vocab) in fp32, for the rows that are sampled."""
        return self.output(hidden).float()

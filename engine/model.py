"""The LLaMA forward pass over a paged KV cache, in the shape of gpt-fast.

Transformer → TransformerBlock → Attention / FeedForward / RMSNorm. The step's tokens of all
sequences are flattened into one row of T tokens; attention finds each sequence's keys through
the metadata built once per step (engine/attention.py). Q/K/V and gate/up projections are fused
into one matmul each. The residual stream is carried beside each sublayer's output so that the
add and the next RMSNorm are one operation (engine/ops.py: fused kernels on CUDA). Weights are
attached by the loader; nothing here knows file formats.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine import ops
from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add rides along with the norm."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wqkv = nn.Linear(config.dim, config.q_dim + 2 * config.kv_dim, bias=False)
        self.wo = nn.Linear(config.q_dim, config.dim, bias=False)

    def project(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: torch.Tensor,
        slots: torch.Tensor,
        store: bool = True,
    ) -> torch.Tensor:
        """Q, K and V of x, (T, n_heads + 2 n_kv, hd): RoPE on Q and K, and K and V stored in the
        pool at `slots`; with `store` False, as the product left them (attention does the
        rest: AttentionMetadata.fused_decodes)."""
        t, hd, h, kv = x.shape[0], self.head_dim, self.n_heads, self.n_kv_heads
        qkv = self.wqkv(x).view(t, h + 2 * kv, hd)
        if store:
            ops.rope_and_store(qkv, cos, sin, kv_pool, slots, h, kv)
        return qkv

    def attend(
        self,
        qkv: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention of `project`'s rows, (T, n_heads, hd) (into `out` if given). `rope`: the
        rows' (cos, sin), which a step with `meta.fused_decodes` needs (project stored
        nothing)."""
        fused = meta.fused_decodes
        if fused is not None:
            assert rope is not None, "a step whose attention rotates its tokens needs their angles"
            assert fused.new_tokens is not None  # for the type checker: fused_decodes said so
            heads = fused.new_tokens.attend_new(
                qkv, *rope, meta.slot_mapping, kv_pool, fused.tables, fused.context_lens
            )
            return heads if out is None else out.copy_(heads)
        h, kv = self.n_heads, self.n_kv_heads
        q, k, v = qkv[:, :h], qkv[:, h : h + kv], qkv[:, h + kv :]  # (T, heads, hd) each
        return paged_attention(q, k, v, kv_pool, meta, out)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.project(x, cos, sin, kv_pool, meta.slot_mapping, meta.fused_decodes is None)
        out = self.attend(qkv, kv_pool, meta, rope=(cos, sin))
        return self.wo(out.reshape(x.shape[0], -1))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.gate_up_silu(x, self.w13))


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
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output; residual: the stream before it (None at the first
        layer). Returns this block's MLP output and the stream before it."""
        store = meta.fused_decodes is None
        qkv, residual = self.begin(x, residual, cos, sin, kv_pool, meta.slot_mapping, store)
        return self.finish(self.attention.attend(qkv, kv_pool, meta, rope=(cos, sin)), residual)

    def begin(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: torch.Tensor,
        slots: torch.Tensor,
        store: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block up to attention: (Q/K/V with K and V stored unless not `store`, the
        stream)."""
        h, residual = self.attention_norm(x, residual)
        return self.attention.project(h, cos, sin, kv_pool, slots, store), residual

    def finish(
        self, heads: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block from attention's output (T, n_heads, hd) on: (the MLP's output, the stream
        before it)."""
        x = self.attention.wo(heads.reshape(heads.shape[0], -1))
        h, residual = self.ffn_norm(x, residual)
        return self.feed_forward(h), residual

    def projections(self) -> list[nn.Module]:
        """The block's four projections in the order the forward pass reads them: QKV, output,
        gate/up, down (the fused decoders take them so)."""
        attention, ffn = self.attention, self.feed_forward
        return [attention.wqkv, attention.wo, ffn.w13, ffn.w2]


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
        x = self.tok_embeddings(tokens)  # (T, dim)
        cos, sin = self.rope_tables(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, kv.layer(i), meta)
        return self.norm(x, residual)[0]

    def blocks(self) -> list[TransformerBlock]:
        return [cast(TransformerBlock, layer) for layer in self.layers]

    def rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (T, hd) of each token's rotary angles."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, hd / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, dim) → (N, vocab) in fp32, for the rows that are sampled."""
        if hidden.is_cuda and hidden.dtype != torch.float32 and type(self.output) is nn.Linear:
            # fp32 straight out of the GEMM's accumulators: no rounding to the model's dtype,
            # and no pass over the logits to widen them (mm's out_dtype is CUDA's alone).
            return torch.mm(hidden, self.output.weight.t(), out_dtype=torch.float32)
        return self.output(hidden).float()

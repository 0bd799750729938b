"""Decode-only CPU steps with the whole layer stack in one native call.

Where every projection of an fp32 model is served from GGUF codes (`CodesLinear`) and decode
attention is native, a step of single-token decodes runs its layers as one
`torch.classes.tandem.DecodeStack.forward` (engine/csrc/cpu_kernels.cpp) over the same kernels
the Python modules call one by one; only the embedding lookup, the rotary tables and the final
norm stay in Python. A small model's one-row step is mostly Python-level calls per layer, which
this removes (bench/RESULTS-cpu.md has the numbers). Steps with prefills go through the model as
usual.
"""

from __future__ import annotations

from typing import cast

import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata, KernelDecode
from engine.codes_linear import CodesLinear
from engine.kv_cache import KVCache
from engine.model import Transformer


class NativeDecoder:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        c = model.config
        norms: list[torch.Tensor] = []
        projections: list[CodesLinear] = []
        for block in model.blocks():  # DecodeStack takes the projections in the forward's order
            norms += [block.attention_norm.weight, block.ffn_norm.weight]
            projections += [cast(CodesLinear, p) for p in block.projections()]
        self.stack = torch.classes.tandem.DecodeStack(
            norms,
            [p.codes for p in projections],
            [p.scale for p in projections],
            [p.minimum for p in projections],
            [p.bits for p in projections],
            c.n_heads,
            c.n_kv_heads,
            c.rms_norm_eps,
        )

    @staticmethod
    def fits(model: Transformer, decode_kernel: object) -> bool:
        """The engine attends decodes with the native kernel (an fp32 CPU model of its head
        dims), and every projection is served from GGUF codes."""
        return isinstance(decode_kernel, cpu_kernels.PagedDecode) and all(
            isinstance(p, CodesLinear) for block in model.blocks() for p in block.projections()
        )

    @staticmethod
    def serves(meta: AttentionMetadata) -> bool:
        """A step of single-token decodes only, attended by the native kernel."""
        return not meta.prefills and isinstance(meta.decodes, KernelDecode)

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache
    ) -> torch.Tensor:
        """tokens, positions: (B,), one per sequence. Returns the final-normed hidden (B, dim)."""
        decodes = meta.decodes
        assert isinstance(decodes, KernelDecode)  # for the type checker: `serves` said so
        x = self.model.tok_embeddings(tokens)  # (B, dim)
        cos, sin = self.model.rope_tables(positions, x.dtype)
        x, residual = self.stack.forward(
            x,
            cos,
            sin,
            kv.pool,
            meta.slot_mapping,
            decodes.tables,
            decodes.context_lens,
            kv.block_size,
        )
        return self.model.norm(x, residual)[0]

"""Batch-1 decode steps on CUDA through fused kernels: five launches a layer instead of ~12.

A one-row step reads every weight once and little else, so its time is the weights' bytes over
the memory's bandwidth plus whatever leaves the memory idle: launches, and small kernels between
the products. Here a layer is

    QKV ← RMSNorm, fused in front              (engine/kernels/row_gemv.py)
    RoPE, K/V store, attention, merge          (engine/kernels/rope_attention.py)
    O → residual add, fused behind
    gate/up ← RMSNorm in front, SiLU·up behind
    down → residual add

and the final norm rides in front of the output head. With int8 or fp8 weights, gate/up and the head
run on the tensor cores (engine/kernels/row_gemv_tc.py) where their shapes and norm weights
fit. On Hopper every launch is a programmatic dependent launch, so a product's weights stream
in while the kernel before it finishes.
DecodeGraphs captures this for its batch-1 bucket; the arithmetic is the model's own, rounding
included, so it agrees with model.py's path to bf16 tolerance.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import nn
from triton.compiler.errors import CompilationError

from engine.kernels import row_gemv_tc as tc
from engine.kernels.rope_attention import RopeAttention
from engine.kernels.row_gemv import NORM, RESIDUAL, STORE, SWIGLU, row_gemv
from engine.kv_cache import KVCache
from engine.model import Transformer
from engine.quant import Fp8Linear, Int8Linear

log = logging.getLogger(__name__)


def _weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's weight, and its per-row scale where the weight is int8 or fp8."""
    if isinstance(module, Int8Linear | Fp8Linear):
        return module.weight, module.scale
    return cast(nn.Linear, module).weight, None


class RowDecoder:
    def __init__(self, model: Transformer, kv: KVCache) -> None:
        c = model.config
        self.model, self.kv = model, kv
        self.eps = c.rms_norm_eps
        self.shape = (c.n_heads + 2 * c.n_kv_heads, c.head_dim)
        device = kv.pool.device
        self.attention = RopeAttention(
            1, c.n_heads, c.n_kv_heads, c.head_dim, kv.block_size, c.max_seq_len, device
        )
        # Programmatic dependent launch needs Hopper or later.
        self.pdl = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
        # Int8/fp8 gate/up and head products on the tensor cores where they fit (row_gemv_tc.py).
        tensor_cores = tc.available(device)

        def on_tensor_cores(module: nn.Module, epilogue: int, norm: torch.Tensor) -> bool:
            w, scale = _weights(module)
            n, k = w.shape
            return tensor_cores and scale is not None and tc.fits(n, k, epilogue, norm)

        self.gate_up_tc = [
            on_tensor_cores(b.feed_forward.w13, SWIGLU, b.ffn_norm.weight) for b in model.blocks()
        ]
        self.head_tc = on_tensor_cores(model.output, STORE, model.norm.weight)

    @classmethod
    def for_model(cls, model: Transformer, kv: KVCache) -> RowDecoder | None:
        """A decoder for `model`, where its weights allow one (`fits`) and its KV cache is in
        the model's dtype (the row attention kernel reads no fp8); else None."""
        fits = cls.fits(model) and kv.pool.dtype == model.norm.weight.dtype
        return cls(model, kv) if fits else None

    @staticmethod
    def fits(model: Transformer) -> bool:
        """A bf16/fp16 model on CUDA whose projections are plain weights, int8 or fp8
        (engine/quant.py), with widths a multiple of 4."""
        weight = model.norm.weight
        if not weight.is_cuda or weight.dtype not in (torch.bfloat16, torch.float16):
            return False
        hd = model.config.head_dim
        if hd & (hd - 1):  # the attention kernel's tiles are powers of two
            return False
        projections = [model.output, *(p for b in model.blocks() for p in b.projections())]
        for module in projections:
            if type(module) not in (nn.Linear, Int8Linear, Fp8Linear):
                return False
            w, scale = _weights(module)
            if not w.is_contiguous() or (scale is not None and w.shape[1] % 4):
                return False
        return True

    def __call__(
        self,
        token: torch.Tensor,
        slot: torch.Tensor,
        context_len: torch.Tensor,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """token, slot, context_len: (1,); table: (1, max_blocks). Returns (1, vocab) fp32
        logits; the new token's K/V are in the pool."""
        model, pdl = self.model, self.pdl
        stream = model.tok_embeddings(token)  # (1, dim)
        squares = None  # the stream's partial sums of squares, from the product that wrote it
        for i, block in enumerate(model.blocks()):
            attention, ffn = block.attention, block.feed_forward
            qkv, _ = self._normed(
                False, stream, attention.wqkv, block.attention_norm.weight, squares
            )
            heads = self.attention(
                qkv.view(1, *self.shape), model.inv_freq, self.kv.layer(i), table,
                context_len, slot, pdl=pdl,
            )  # fmt: skip
            stream, squares = row_gemv(
                heads.view(1, -1), *_weights(attention.wo), epilogue=RESIDUAL, residual=stream,
                pdl=pdl,
            )  # fmt: skip
            hidden, _ = self._normed(
                self.gate_up_tc[i], stream, ffn.w13, block.ffn_norm.weight, squares,
                epilogue=SWIGLU,
            )  # fmt: skip
            stream, squares = row_gemv(
                hidden, *_weights(ffn.w2), epilogue=RESIDUAL, residual=stream, pdl=pdl
            )
        logits, _ = self._normed(
            self.head_tc, stream, model.output, model.norm.weight, squares,
            out_dtype=torch.float32,
        )  # fmt: skip
        return logits

    def _normed(
        self,
        tensor_cores: bool,
        x: torch.Tensor,
        module: nn.Module,
        norm: torch.Tensor,
        squares: torch.Tensor | None,
        **epilogue: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """module's weights @ (rms_norm(x) * norm), through row_gemv_tc.py or row_gemv.py."""
        w, scale = _weights(module)
        if tensor_cores:
            assert scale is not None
            try:
                return tc.row_gemv_tc(
                    x, w, scale, norm_weight=norm, squares=squares, eps=self.eps, pdl=self.pdl,
                    **epilogue,
                )  # fmt: skip
            except CompilationError as error:
                # Gluon is experimental and a later Triton may not build this kernel. The first
                # calls run before graph capture, so the fallback is decided there, once.
                last = (str(error).splitlines() or [type(error).__name__])[-1]
                log.warning("int8 tensor-core products unavailable, row_gemv serves them: %s", last)
                self.gate_up_tc = [False] * len(self.gate_up_tc)
                self.head_tc = False
        return row_gemv(
            x, w, scale, prologue=NORM, norm_weight=norm, squares=squares, eps=self.eps,
            pdl=self.pdl, **epilogue,
        )  # fmt: skip

"""Weights in one canonical naming, assembled into the model's fused layout on the `meta` device.

Readers (GGUF, safetensors) yield tensors named as in Hugging Face's LLaMA, with Q/K rows in HF's
rotate-half order; `build_model` fuses Q/K/V and gate/up and attaches everything with
`assign=True`, so no memory is spent on random initialisation. Projections whose GGUF blocks are
4-bit (or Q8_0) may stay quantized: their `nn.Linear` is swapped for a `CodesLinear` (the native
CPU kernel, where it is built) or an `Int4Linear` (torch's int4 kernel) the model never knows of.
Float projections may be swapped as they are built (`linear`, e.g. weight-only int8): each
weight is converted while it alone is in memory, so a model whose float weights would not fit
the device (LLaMA-3-70B's 141 GB on one H200) loads straight into its quantized form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from engine.codes_linear import CodesLinear
from engine.config import ModelConfig
from engine.errors import ModelFormatError
from engine.model import Transformer
from engine.quant import Int4Linear, Q4Blocks
from engine.rope import inverse_frequencies

# The model's fused projections (under `layers.{i}.`) and the HF weights each one stacks.
PROJECTIONS = {
    "attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.wo": ("self_attn.o_proj",),
    "feed_forward.w13": ("mlp.gate_proj", "mlp.up_proj"),
    "feed_forward.w2": ("mlp.down_proj",),
}
NORMS = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


class WeightSource(Protocol):
    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor:
        """The HF-named tensor in the target dtype."""
        ...

    def get_int4(self, name: str) -> list[Q4Blocks] | None:
        """int4 matrices that sum to it, when it is stored quantized and may stay so; else None."""
        ...

    @property
    def native_codes(self) -> bool:
        """Kept codes are served by the native CPU kernel (else by torch's int4 kernel)."""
        ...


def build_model(
    config: ModelConfig,
    source: WeightSource,
    device: torch.device,
    rope_freq_factors: torch.Tensor | None = None,
    linear: Callable[[torch.Tensor], nn.Module] | None = None,
    linear_head: bool = True,
) -> Transformer:
    """linear: what a float projection (out, in) on `device` becomes; None keeps `nn.Linear`.
    linear_head: whether the output head becomes one too."""
    with torch.device("meta"):
        model = Transformer(config)
    state = {"tok_embeddings.weight": source.get("model.embed_tokens.weight")}
    swapped: dict[str, nn.Module] = {}
    for i in range(config.n_layers):
        for path, parts in PROJECTIONS.items():
            names = [f"model.layers.{i}.{part}.weight" for part in parts]
            int4 = _fused_int4([source.get_int4(name) for name in names], source.native_codes)
            if int4 is not None:
                swapped[f"layers.{i}.{path}"] = int4
                continue
            weight = torch.cat([source.get(n) for n in names])
            if linear is not None:
                swapped[f"layers.{i}.{path}"] = linear(weight.to(device))
            else:
                state[f"layers.{i}.{path}.weight"] = weight
        for ours, theirs in NORMS.items():
            state[f"layers.{i}.{ours}.weight"] = source.get(f"model.layers.{i}.{theirs}.weight")
    state["norm.weight"] = source.get("model.norm.weight")
    tied = config.tie_embeddings or not source.has("lm_head.weight")
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    output = _fused_int4([source.get_int4(head)], source.native_codes)
    if output is not None:
        swapped["output"] = output  # tied or not, the embedding lookup keeps its float table
    else:
        table = state["tok_embeddings.weight"] if tied else source.get(head)
        if linear is not None and linear_head:
            swapped["output"] = linear(table.to(device))
        else:
            state["output.weight"] = table
    expected_shapes = {k: v.shape for k, v in model.state_dict().items()}
    for key, tensor in state.items():
        if tensor.shape != expected_shapes[key]:
            raise ModelFormatError(
                f"weight {key} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected_shapes[key])}"
            )
    for path, module in swapped.items():
        parent, _, name = path.rpartition(".")
        expected = model.get_submodule(path)
        shape = (module.out_features, module.in_features)
        if shape != (expected.out_features, expected.in_features):
            raise ModelFormatError(f"weight {path} does not match the config's shape")
        setattr(model.get_submodule(parent), name, module.to(device))  # "" is the model itself
    missing, unexpected = model.load_state_dict(
        {k: v.to(device) for k, v in state.items()}, assign=True, strict=False
    )
    if unexpected or not all(any(k.startswith(p + ".") for p in swapped) for k in missing):
        raise ModelFormatError(f"weights do not fit the model: missing {missing[:3]}")
    if state.get("output.weight") is state["tok_embeddings.weight"]:
        model.output.weight = model.tok_embeddings.weight  # tied: one tensor, not two copies
    model.inv_freq = inverse_frequencies(
        config.head_dim, config.rope_theta, config.rope_scaling, rope_freq_factors
    ).to(device)
    return model.requires_grad_(False).eval()


def _fused_int4(
    tensors: list[list[Q4Blocks] | None], native: bool
) -> CodesLinear | Int4Linear | None:
    """One quantized layer stacking the rows of several tensors, if all are quantized alike;
    else None."""
    if any(t is None for t in tensors):
        return None
    parts = [t for t in tensors if t is not None]
    if len({len(t) for t in parts}) != 1:
        return None  # e.g. Q4 and Q8_0 mixed in one fused projection: keep it float
    rows = sum(t[0].shape[0] for t in parts)
    if not Int4Linear.fits(rows, parts[0][0].shape[1]):
        return None
    layer = CodesLinear if native else Int4Linear
    return layer(*(Q4Blocks.cat([t[j] for t in parts]) for j in range(len(parts[0]))))

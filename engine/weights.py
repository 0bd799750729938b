"""Weights in one canonical naming, assembled into the model's fused layout on the `meta` device.

Readers (GGUF, safetensors) yield tensors named as in Hugging Face's LLaMA, with Q/K rows in HF's
rotate-half order; `build_model` fuses Q/K/V and gate/up and attaches everything with
`assign=True`, so no memory is spent on random initialisation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import ModelConfig
from engine.errors import ModelFormatError
from engine.model import Transformer
from engine.rope import inverse_frequencies

# Per-layer parts, by their HF names under `model.layers.{i}.`.
LAYER_PARTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)

Getter = Callable[[str], torch.Tensor]  # canonical (HF) name → tensor, already in the target dtype


def build_model(
    config: ModelConfig,
    get: Getter,
    has: Callable[[str], bool],
    device: torch.device,
    rope_freq_factors: torch.Tensor | None = None,
) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    state: dict[str, torch.Tensor] = {"tok_embeddings.weight": get("model.embed_tokens.weight")}
    for i in range(config.n_layers):

        def part(name: str, i: int = i) -> torch.Tensor:
            return get(f"model.layers.{i}.{name}")

        prefix = f"layers.{i}."
        state[prefix + "attention.wqkv.weight"] = torch.cat(
            [
                part("self_attn.q_proj.weight"),
                part("self_attn.k_proj.weight"),
                part("self_attn.v_proj.weight"),
            ]
        )
        state[prefix + "attention.wo.weight"] = part("self_attn.o_proj.weight")
        state[prefix + "feed_forward.w13.weight"] = torch.cat(
            [part("mlp.gate_proj.weight"), part("mlp.up_proj.weight")]
        )
        state[prefix + "feed_forward.w2.weight"] = part("mlp.down_proj.weight")
        state[prefix + "attention_norm.weight"] = part("input_layernorm.weight")
        state[prefix + "ffn_norm.weight"] = part("post_attention_layernorm.weight")
    state["norm.weight"] = get("model.norm.weight")
    if has("lm_head.weight") and not config.tie_embeddings:
        state["output.weight"] = get("lm_head.weight")
    else:
        state["output.weight"] = state["tok_embeddings.weight"]
    _check_shapes(model, state)
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=True, strict=True)
    if state["output.weight"] is state["tok_embeddings.weight"]:
        model.output.weight = model.tok_embeddings.weight  # tied: one tensor, not two copies
    inv_freq = inverse_frequencies(
        config.head_dim, config.rope_theta, config.rope_scaling, rope_freq_factors
    )
    model.inv_freq = inv_freq.to(device)
    return model.requires_grad_(False).eval()


def _check_shapes(model: Transformer, state: dict[str, torch.Tensor]) -> None:
    expected = {k: v.shape for k, v in model.state_dict().items()}
    for name, tensor in state.items():
        if tensor.shape != expected[name]:
            raise ModelFormatError(
                f"weight {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name])}"
            )

"""Loading a model from a GGUF file or a Hugging Face safetensors folder, with a progress bar."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.config import ModelConfig
from engine.errors import ModelFormatError, ModelNotFound
from engine.gguf_file import open_gguf
from engine.gguf_weights import GGUFWeights
from engine.hf_weights import SafetensorsWeights, read_config
from engine.model import Transformer
from engine.weights import build_model


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    path: Path
    weight_format: str  # e.g. "gguf:Q4_1" or "safetensors"


def load_model(
    path: Path, device: torch.device, dtype: torch.dtype, progress: bool = True
) -> LoadedModel:
    if path.is_dir():
        return _load_hf(path, device, dtype, progress)
    if path.is_file():
        return _load_gguf(path, device, dtype, progress)
    raise ModelNotFound(f"no such model file or folder: {path}")


def _load_gguf(path: Path, device: torch.device, dtype: torch.dtype, progress: bool) -> LoadedModel:
    gguf = open_gguf(path)
    config = ModelConfig.from_gguf(gguf.metadata)
    weights = GGUFWeights(gguf, config.n_heads, config.n_kv_heads)
    tied = not weights.has("lm_head.weight")
    config = _with(config, tie_embeddings=tied)
    kind = weights.quant_type("model.layers.0.self_attn.q_proj.weight") if config.n_layers else ""
    with _bar(weights.nbytes(), path.name, progress) as bar:

        def get(name: str) -> torch.Tensor:
            tensor = weights.get(name).to(dtype)
            bar.update(int(weights.by_name[name].n_bytes))
            return tensor

        model = build_model(config, get, weights.has, device, weights.rope_freq_factors())
    return LoadedModel(model, config, path, f"gguf:{kind}")


def _load_hf(path: Path, device: torch.device, dtype: torch.dtype, progress: bool) -> LoadedModel:
    config = ModelConfig.from_hf(read_config(path))
    weights = SafetensorsWeights(path)
    with _bar(weights.nbytes(), path.name, progress) as bar:

        def get(name: str) -> torch.Tensor:
            tensor = weights.get(name)
            bar.update(tensor.numel() * tensor.element_size())
            return tensor.to(dtype)

        model = build_model(config, get, weights.has, device)
    return LoadedModel(model, config, path, "safetensors")


def _bar(total: int, name: str, enabled: bool) -> tqdm:
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"load {name}",
        disable=not enabled,
        file=sys.stderr,
        leave=False,
    )


def _with(config: ModelConfig, **changes: object) -> ModelConfig:
    from dataclasses import replace

    try:
        return replace(config, **changes)  # type: ignore[arg-type]
    except TypeError as err:
        raise ModelFormatError(str(err)) from err

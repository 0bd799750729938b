"""The shape of a LLaMA-family model, read from GGUF metadata or a Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ModelFormatError


@dataclass(frozen=True)
class RopeScaling:
    """LLaMA-3.1's frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_seq_len: int
    tie_embeddings: bool
    head_dim: int = 0  # 0: dim // n_heads
    rope_scaling: RopeScaling | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // max(self.n_heads, 1))
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, field) <= 0:
                raise ModelFormatError(f"model config: {field} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise ModelFormatError(
                f"model config: n_heads ({self.n_heads}) is not a multiple of "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelFormatError(f"model config: head_dim {self.head_dim} must be even for RoPE")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> ModelConfig:
        arch = metadata.get("general.architecture")
        if arch != "llama":
            raise ModelFormatError(f"unsupported GGUF architecture {arch!r}: tandem serves 'llama'")

        def key(name: str, default: Any = None) -> Any:
            value = metadata.get(f"llama.{name}", default)
            if value is None:
                raise ModelFormatError(f"GGUF metadata lacks 'llama.{name}'")
            return value

        n_heads = int(key("attention.head_count"))
        dim = int(key("embedding_length"))
        vocab = metadata.get("llama.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
        return cls(
            vocab_size=int(vocab),
            dim=dim,
            n_layers=int(key("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(key("attention.head_count_kv", n_heads)),
            ffn_dim=int(key("feed_forward_length")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            max_seq_len=int(key("context_length")),
            tie_embeddings=False,  # decided by the loader: tied when there is no output.weight
            head_dim=int(metadata.get("llama.attention.key_length", dim // n_heads)),
            # llama.cpp stores LLaMA-3 rope scaling as a `rope_freqs` tensor, read by the loader.
            rope_scaling=None,
            name=str(metadata.get("general.name", "")),
        )

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        archs = config.get("architectures") or ["LlamaForCausalLM"]
        if config.get("model_type", "llama") != "llama" or "LlamaForCausalLM" not in archs:
            raise ModelFormatError(
                f"unsupported Hugging Face model {archs} ({config.get('model_type')!r}): "
                "tandem serves LlamaForCausalLM"
            )
        try:
            n_heads = int(config["num_attention_heads"])
            dim = int(config["hidden_size"])
            raw_scaling = config.get("rope_scaling")
            scaling = None
            if raw_scaling:
                kind = raw_scaling.get("rope_type", raw_scaling.get("type"))
                if kind == "llama3":
                    scaling = RopeScaling(
                        factor=float(raw_scaling["factor"]),
                        low_freq_factor=float(raw_scaling["low_freq_factor"]),
                        high_freq_factor=float(raw_scaling["high_freq_factor"]),
                        original_max_position_embeddings=int(
                            raw_scaling["original_max_position_embeddings"]
                        ),
                    )
                elif kind != "default":
                    raise ModelFormatError(f"unsupported rope_scaling type {kind!r}")
            return cls(
                vocab_size=int(config["vocab_size"]),
                dim=dim,
                n_layers=int(config["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
                ffn_dim=int(config["intermediate_size"]),
                rope_theta=float(config.get("rope_theta", 10000.0)),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                max_seq_len=int(config.get("max_position_embeddings", 2048)),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                head_dim=int(config.get("head_dim") or dim // n_heads),
                rope_scaling=scaling,
                name=str(config.get("_name_or_path", "")),
            )
        except KeyError as err:
            raise ModelFormatError(f"config.json lacks {err.args[0]!r}") from err

"""Reading a LLaMA GGUF's tensors as HF-named torch tensors, dequantized with the `gguf` package.

llama.cpp's converter permutes the rows of Q and K so that RoPE rotates interleaved pairs; our
model rotates halves (as Hugging Face does), so those rows are permuted back here.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from engine.errors import ModelFormatError
from engine.gguf_file import GGUFFile
from engine.quant import Q4Blocks, q4_blocks, q8_0_as_q4_pair

SUPPORTED = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    return None


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row order: (n_heads * hd, dim) → rotate-half order."""
    rows, cols = weight.shape
    half = rows // n_heads // 2
    w = weight.reshape(n_heads, half, 2, cols)  # (heads, hd/2, pair, dim)
    return w.transpose(1, 2).reshape(rows, cols)  # (heads, pair, hd/2, dim) flattened


class GGUFWeights:
    """Lazy access to a GGUF's tensors by HF name; each is dequantized when first asked for."""

    def __init__(self, gguf: GGUFFile, n_heads: int, n_kv_heads: int) -> None:
        self.gguf = gguf
        # The heads whose rows llama.cpp permuted, by HF name part.
        self.qk_heads = {"q_proj": n_heads, "k_proj": n_kv_heads}
        self.by_name: dict[str, ReaderTensor] = {
            name: tensor for tensor in gguf.reader.tensors if (name := hf_name(tensor.name))
        }

    def has(self, name: str) -> bool:
        return name in self.by_name

    def quant_type(self, name: str) -> str:
        return self.by_name[name].tensor_type.name

    def get(self, name: str) -> torch.Tensor:
        """The tensor as float32, in HF layout (out_features, in_features)."""
        out = self._dequantize(self._tensor(name))
        heads = self.qk_heads.get(name.split(".")[-2], 0)
        return unpermute_qk(out, heads) if heads else out

    def get_int4(self, name: str) -> list[Q4Blocks] | None:
        """The tensor as int4 matrices that sum to it (HF row order): one for Q4_0/Q4_1, two for
        Q8_0; None for other types."""
        tensor = self._tensor(name)
        rows, cols = (int(d) for d in reversed(tensor.shape))
        try:
            if tensor.tensor_type in (Q.Q4_0, Q.Q4_1):
                parts = [q4_blocks(tensor.data, tensor.tensor_type, (rows, cols))]
            elif tensor.tensor_type == Q.Q8_0:
                parts = list(q8_0_as_q4_pair(tensor.data, (rows, cols)))
            else:
                return None
        except ValueError as err:
            raise ModelFormatError(f"{self.gguf.path.name}: tensor {tensor.name}: {err}") from err
        heads = self.qk_heads.get(name.split(".")[-2], 0)
        if heads:
            order = unpermute_qk(torch.arange(rows, dtype=torch.float32)[:, None], heads)
            parts = [p.rows(order[:, 0].long()) for p in parts]
        return parts

    def _tensor(self, name: str) -> ReaderTensor:
        if name not in self.by_name:
            raise ModelFormatError(f"{self.gguf.path.name}: missing tensor for {name}")
        return self.by_name[name]

    def rope_freq_factors(self) -> torch.Tensor | None:
        freqs = next((t for t in self.gguf.reader.tensors if t.name == "rope_freqs.weight"), None)
        return None if freqs is None else self._dequantize(freqs)

    def _dequantize(self, tensor: ReaderTensor) -> torch.Tensor:
        if tensor.tensor_type not in SUPPORTED:
            raise ModelFormatError(
                f"{self.gguf.path.name}: tensor {tensor.name} has quantization "
                f"{tensor.tensor_type.name}, which tandem does not read (supported: "
                f"{', '.join(sorted(q.name for q in SUPPORTED))})"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
            array = np.asarray(array, dtype=np.float32).reshape(shape)
            if not array.flags.writeable:  # float32 tensors come back as views of the mapped file
                array = array.copy()
        except (ValueError, IndexError) as err:
            raise ModelFormatError(
                f"{self.gguf.path.name}: tensor {tensor.name} is corrupt: {err}"
            ) from err
        return torch.from_numpy(array)

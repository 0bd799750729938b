"""The KV block pool: the memory the worker owns. The scheduler only counts its blocks."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequest
from engine.memory import huge_page_buffer

# "fp8": e4m3 with a scale of 1, as vLLM stores it without calibrated scales: K and V of LLaMA
# models stay far inside its ±448, and its 3 mantissa bits are what the accuracy rows measure.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}


def pool_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for --kv-cache-dtype `name`: "auto" is the model's."""
    if name not in KV_CACHE_DTYPES:
        raise InvalidRequest(
            "kv_cache_dtype", f"unknown KV cache dtype {name!r}; choose {tuple(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[name] or model_dtype


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the pool stores it: a narrower float saturates instead of overflowing."""
    if x.dtype == dtype:
        return x
    if dtype.is_floating_point and dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


class KVCache:
    """Per layer, one pool of (num_blocks * block_size, 2, n_kv_heads, head_dim): a token's K and
    V side by side, so one index op writes or gathers both.

    A sequence's token at position p lives in block `block_table[p // block_size]`, at offset
    `p % block_size`; `slot = block * block_size + offset` indexes the flattened pool.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("KV cache needs a positive number of blocks and block size")
        self.block_size = block_size
        shape = (config.n_layers, num_blocks * block_size, 2, config.n_kv_heads, config.head_dim)
        if device.type == "cpu":
            # A decode reads each sequence's blocks, scattered over the pool, in runs: on huge
            # pages its attention at 2,000 tokens took 15% less time (bench/RESULTS-cpu.md).
            size = torch.Size(shape).numel() * dtype.itemsize
            buffer = huge_page_buffer(size, "the KV cache")
            self.pool = buffer.view(dtype).view(shape).zero_()
        else:
            self.pool = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, index: int) -> torch.Tensor:
        """One layer's pool, (num_slots, 2, n_kv_heads, head_dim)."""
        return self.pool[index]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * config.n_layers * block_size * config.kv_dim * dtype.itemsize

"""The KV block pool: the memory the worker owns. The scheduler only counts its blocks."""

from __future__ import annotations

import torch

from engine.config import ModelConfig


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
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.n_layers, num_blocks * block_size, 2, config.n_kv_heads, config.head_dim)
        self.pool = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, index: int) -> torch.Tensor:
        """One layer's pool, (num_slots, 2, n_kv_heads, head_dim)."""
        return self.pool[index]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.n_layers * block_size * config.kv_dim * element

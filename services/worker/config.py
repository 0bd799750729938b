"""The worker's configuration, built once from flags in its __main__."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerConfig:
    model_path: Path
    model_name: str
    host: str = "127.0.0.1"
    port: int = 50053
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_bytes: int = 1 << 30  # 0 on CUDA: what the weights leave of gpu_memory_fraction
    block_size: int = 16
    quantize: str = "auto"
    max_num_seqs: int = 256  # sizes the CUDA graphs and attention buffers
    cuda_graphs: bool = True
    gpu_memory_fraction: float = 0.9
    threads: int = 1  # intra-op threads on CPU

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.kv_cache_bytes < 0:
            raise ValueError("kv_cache_bytes must be >= 0")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.threads < 1:
            raise ValueError("threads must be positive")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be 8, 16, 32, 64 or 128, got {self.block_size}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

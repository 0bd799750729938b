"""The worker's settings: where the model runs and how (shared with `tandem run` and serve)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine import registry
from services.address import join_address
from services.settings import flag
from services.telemetry.config import TelemetryConfig
from services.tls import TlsSettings

if TYPE_CHECKING:
    from engine.rank_group import EngineArgs

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZE = ("auto", "int4", "int8", "fp8", "none")
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class ModelSettings:
    model: str = flag(
        registry.DEFAULT_MODEL, "model name (`tandem models list`) or path", env="TANDEM_MODEL"
    )
    home: str = flag("~/.cache/tandem", "where model files are cached", env="TANDEM_HOME")


@dataclass(frozen=True)
class EngineSettings:
    device: str = flag("cpu", "cpu or cuda")
    dtype: str = flag(
        "auto",
        "activations and dequantized weights (auto: float32 on CPU, bfloat16 on CUDA)",
        choices=DTYPES,
    )
    quantize: str = flag(
        "auto",
        "auto: the fastest measured choice (bench/RESULTS-cpu.md, RESULTS-gpu.md): on CPU a "
        "GGUF's Q4_0/Q4_1/Q8_0 codes through tandem's native int8 kernels where they build, "
        "else int4; int4 (CPU): the codes through torch's int4 kernel, bf16 activations; "
        "int8: weight-only int8, per-channel scales; fp8 (CUDA compute capability 8.9+; on CPU "
        "exact but slow): e4m3 weights, per-channel scales, FP8 GEMMs with per-token activation "
        "scales beyond a few rows, the output head in --dtype; "
        "none: dequantized weights in --dtype",
        choices=QUANTIZE,
    )
    kv_cache_dtype: str = flag(
        "auto",
        "the KV cache's dtype (auto: --dtype's; fp8: e4m3, scale 1, twice the tokens per MiB)",
        choices=KV_CACHE_DTYPES,
    )
    kv_cache_mb: int = flag(
        1024, "KV cache memory in MiB (0 on CUDA: what the weights leave of --gpu-memory-fraction)"
    )
    block_size: int = flag(16, "tokens per KV block")
    max_model_len: int = flag(
        0,
        "the longest sequence served, prompt and output, in tokens (0: the model's context); "
        "a longer prompt is refused, an output stops there",
    )
    enforce_eager: bool = flag(
        False, "no CUDA graphs (decode steps, and steps with prompts in pieces)"
    )
    threads: int = flag(
        0,
        "CPU threads for batched steps and prefills (0: all cores; small decode steps leave "
        "one core to the other processes)",
    )
    tensor_parallel_size: int = flag(
        1,
        "shard the model over this many ranks, a process each (torch.distributed: NCCL and one "
        "GPU a rank on CUDA, gloo on CPU); the KV cache size is per rank",
    )
    gpu_memory_fraction: float = flag(0.9, "share of the GPU for weights, activations and KV cache")
    overlap_steps: bool = flag(
        True,
        "the worker launches each decode-only step before it has read the tokens of the step "
        "before, which the engine feeds it on the device (CUDA with one rank; elsewhere off)",
    )

    def __post_init__(self) -> None:
        if self.kv_cache_mb < 0:
            raise ValueError("kv_cache_mb must be >= 0")
        if self.kv_cache_mb == 0 and not self.device.startswith("cuda"):
            # Sized from what the weights leave of a GPU; elsewhere it would be one block.
            raise ValueError(
                f"kv_cache_mb 0 sizes the KV cache on CUDA only: on {self.device} give MiB"
            )
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        if self.threads < 0:
            raise ValueError("threads must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.max_model_len < 0 or self.max_model_len == 1:
            raise ValueError(f"max_model_len must be 0 or at least 2, got {self.max_model_len}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be 8, 16, 32, 64 or 128, got {self.block_size}")

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    def engine_args(
        self, path: Path, max_num_seqs: int = 256, warm_up_tokens: int = 2048
    ) -> EngineArgs:
        """What every rank of the engine loads from (engine/rank_group.py)."""
        from engine.rank_group import EngineArgs  # torch, only where a model is loaded

        return EngineArgs(
            path,
            self.device,
            self.resolved_dtype,
            self.kv_cache_mb << 20,
            self.block_size,
            self.quantize,
            max_num_seqs,
            not self.enforce_eager,
            self.gpu_memory_fraction,
            warm_up_tokens,
            progress=False,
            kv_cache_dtype=self.kv_cache_dtype,
            max_model_len=self.max_model_len,
        )


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    host: str = flag("127.0.0.1", "address to bind")
    port: int = flag(50053, "gRPC port")
    max_num_seqs: int = flag(256, "the largest batch (sizes CUDA graphs and buffers)")
    max_num_batched_tokens: int = flag(
        2048, "the largest step in new tokens (what is compiled and captured at start on CUDA)"
    )
    engine: EngineSettings = field(default_factory=EngineSettings)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    tls: TlsSettings = field(default_factory=TlsSettings)  # on this port, across hosts

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")

    @property
    def address(self) -> str:
        return join_address(self.host, self.port)

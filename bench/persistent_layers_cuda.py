"""bench/persistent_layers.cu compiled at run time (NVRTC, through torch) for the layers of
bench/persistent_layers.py: a persistent kernel written in CUDA, so that each block's registers,
bytes in flight and barrier are chosen by hand rather than by Triton.

A config reads "cuda THREADS PER_SM [ahead=N] [deep=N] [nap=NS] [flag=1] [skip=N]": threads a
block, blocks an SM (all resident), units of weights (4 rows x 512 inputs) a warp requests into
registers while each barrier waits (0, 1 or 2) and how many more it copies into shared memory then,
nanoseconds a barrier's poller sleeps between polls (0: none), whether
the blocks poll a flag the last arrival sets instead of the arrivals' counter, and, to take the
time apart, what to leave out: 1 the barriers' waits, 2 the inputs' loads, 3 both (wrong
results)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from bench.persistent_layers import Layers

SOURCE = Path(__file__).with_name("persistent_layers.cu")
MAX_ROWS = 256  # as the kernel's MAX_ROWS: weight rows a block may own in one product
SPINS = 200_000  # polls before a barrier gives up: not all blocks resident

_DEFAULTS = {"ahead": 1, "deep": 0, "nap": 0, "flag": 0, "skip": 0}  # a config's options
# cuFuncGetAttribute's attributes
_REGISTERS, _LOCAL_BYTES = 4, 3


@dataclass(frozen=True)
class CudaConfig:
    threads: int
    per_sm: int
    ahead: int = 1
    deep: int = 0
    nap: int = 0
    flag: int = 0
    skip: int = 0

    @classmethod
    def parse(cls, text: str) -> CudaConfig:
        word, threads, per_sm, *options = text.split()
        assert word == "cuda", (
            f"'cuda THREADS PER_SM [ahead=N] [deep=N] [nap=NS] [flag=1] [skip=N]': {text}"
        )
        pairs = {k: int(v) for k, v in (o.split("=") for o in options)}
        assert set(pairs) <= set(_DEFAULTS), f"options {', '.join(_DEFAULTS)}: {text}"
        config = cls(int(threads), int(per_sm), **pairs)
        assert config.ahead > 0 or not config.deep, f"deep copies follow units in registers: {text}"
        return config

    def __str__(self) -> str:
        options = [f"{k}={getattr(self, k)}" for k, v in _DEFAULTS.items() if getattr(self, k) != v]
        return " ".join([f"cuda {self.threads} {self.per_sm}", *options])


def source(layers: Layers, config: CudaConfig) -> str:
    s = layers.shapes
    options = {k.upper(): getattr(config, k) for k in _DEFAULTS}
    defines = dict(LAYERS=layers.layers, DIM=s.dim, QKV=s.qkv, FFN=s.ffn, THREADS=config.threads,
                   PER_SM=config.per_sm, SPINS=SPINS, **options)  # fmt: skip
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + SOURCE.read_text()


def _libcuda() -> Any:
    """The driver library torch loaded for its compiled kernels (renamed across versions)."""
    utils = torch.cuda._utils
    return getattr(utils, "_get_gpu_runtime_library", None) or utils._get_cuda_library


def _attribute(kernel: Any, attribute: int) -> int:
    value = ctypes.c_int()
    libcuda = _libcuda()()
    libcuda.cuFuncGetAttribute(ctypes.byref(value), attribute, kernel.func)
    return value.value


def _resident(kernel: Any, threads: int, shared: int) -> int:
    """Blocks of the kernel that fit one SM at once, by the driver's occupancy calculator."""
    blocks = ctypes.c_int()
    libcuda = _libcuda()()
    libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), kernel.func, threads, ctypes.c_size_t(shared)
    )
    return blocks.value


def persistent(layers: Layers, config: CudaConfig, eps: float) -> tuple[Any, Any, str]:
    """A call that runs the CUDA kernel (the stream after every layer is its result), a check
    that its barriers all completed, and what was compiled (registers, spills, residency)."""
    s, n, device = layers.shapes, layers.layers, layers.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = sms * config.per_sm
    most = max(-(-s.qkv // blocks), -(-2 * s.ffn // blocks), -(-s.dim // blocks))
    assert most + 4 <= MAX_ROWS, f"{blocks} blocks own up to {most} rows, over {MAX_ROWS}"
    assert blocks <= 2 * config.threads, f"{blocks} blocks: their sums of squares need more threads"
    kernel = torch.cuda._compile_kernel(source(layers, config), "layers")
    units = config.threads // 32 * config.deep * 4 * 512  # bytes of the warps' copied units
    shared = 4 * max(s.dim, s.ffn) + units
    kernel.set_shared_memory_config(shared)
    fit = _resident(kernel, config.threads, shared)
    info = (f"{_attribute(kernel, _REGISTERS)} registers, {_attribute(kernel, _LOCAL_BYTES)} "
            f"bytes local, {fit} blocks an SM fit")  # fmt: skip
    assert fit >= config.per_sm, f"{config}: {info}"
    x, sq, qkv, h, hsq, hidden = layers.activations(blocks, blocks)  # a partial sum a block
    count = torch.zeros(64, dtype=torch.int32, device=device)  # the counter; FLAG_OFFSET on
    failed = torch.zeros(1, dtype=torch.int32, device=device)
    args = [x, sq, qkv, h, hsq, hidden, layers.qkv[0], layers.qkv[1], layers.o[0], layers.o[1],
            layers.gu[0], layers.gu[1], layers.down[0], layers.down[1], layers.attn_norm,
            layers.ffn_norm, count, failed, eps]  # fmt: skip

    def run() -> torch.Tensor:
        count.zero_()
        kernel(grid=(blocks, 1, 1), block=(config.threads, 1, 1), args=args, shared_mem=shared)
        return x[n : n + 1]

    def completed() -> bool:
        return not bool(failed.item())

    return run, completed, info

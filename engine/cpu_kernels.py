"""tandem's native CPU kernels (engine/csrc/cpu_kernels.cpp), compiled once per machine.

They are built on first use by torch's extension builder (a C++ compiler and ninja) for this
CPU's instruction set (`-march=native`), and registered as `torch.ops.tandem.*`. The build
folder's name carries a digest of the source and of the CPU's flags, so a cache shared between
machines never loads code built for another CPU. Where nothing can be built (not x86-64 with
AVX-512 VNNI, no compiler), `load()` says so once in the log and the engine keeps its PyTorch paths.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# The instructions the kernels are written with: AVX-512 VNNI for the integer dot products,
# AVX-512 (F, BW, VL) and FMA/F16C for the rest.
REQUIRED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")

log = logging.getLogger(__name__)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux), empty where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and set(REQUIRED_FLAGS) <= cpu_flags()


def kernel_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    return f"tandem_cpu_{digest.hexdigest()[:12]}"


@functools.cache
def load() -> bool:
    """Build (the first time on this machine: 10-60 s) and load the kernels; False, with
    the reason logged, where they cannot be."""
    if not supported():
        log.info(
            "native CPU kernels need x86-64 with %s; using PyTorch's", "+".join(REQUIRED_FLAGS)
        )
        return False
    from torch.utils import cpp_extension

    # torch's builder runs `ninja` from PATH; the `ninja` wheel installs it into the virtual
    # environment, which is not on PATH when tandem runs as `.venv/bin/tandem` unactivated.
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    name = kernel_name()
    log.info("loading native CPU kernels %s (compiled on first use: about 10-60 s)", name)
    started = time.monotonic()
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with (build_dir / "tandem.lock").open("a") as lock:
            # torch's own lock is a file: a process killed while it held it (a worker killed
            # while starting) leaves it behind, and every later load would wait on it forever.
            # Ours is an flock, released on close or with its holder; holding it, torch's is stale.
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
            )
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
        log.warning("native CPU kernels could not be built (%s); using PyTorch's", err)
        return False
    log.info("native CPU kernels %s ready in %.1f s", name, time.monotonic() - started)
    return True


def usable(x: torch.Tensor) -> bool:
    """Whether a CPU op on x goes native: fp32 activations on a CPU the kernels were built for."""
    return x.dtype == torch.float32 and load()


HEAD_DIMS = (64, 128)  # what the decode attention kernel is compiled for


class PagedPrefill:
    """Every row of a step with prompts attended as `PagedDecode` would attend it at its position
    (the rows of one prompt share each span of keys they read), for `RowwiseAttention`."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __call__(
        self,
        q: torch.Tensor,
        pool: torch.Tensor,
        tables: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        """q: (T, n_heads, hd), sequence after sequence; tables (S, max_blocks), starts and
        lengths (S,) → (T, n_heads, hd)."""
        return torch.ops.tandem.paged_prefill(
            q.contiguous(), pool, tables, starts, lengths, self.block_size
        )


class PagedDecode:
    """Decode attention reading the paged pool through block tables, for `KernelDecode`."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __call__(
        self, q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor
    ) -> torch.Tensor:
        """q: (B, n_heads, hd), a view into the step's QKV rows → (B, n_heads, hd)."""
        return torch.ops.tandem.paged_decode(
            q.contiguous(), pool, tables, context_lens, self.block_size
        )

"""What memory a device has left, so a KV cache too large for it is refused with a message
instead of found out by the kernel's OOM killer (which may pick another process) or by
CUDA's allocator half way through start-up."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.errors import InvalidRequest

_MIB = 1 << 20
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux's madvise advice: back this range with transparent huge pages

log = logging.getLogger(__name__)
# Beside the KV pool a process needs room for a step's activations and logits. On CUDA also
# for the graphs and the kernels' workspaces (a step of 8,192 tokens at LLaMA-3-8B shapes peaks
# 0.82 GiB above what the engine holds after warm-up, bench/RESULTS-gpu.md).
_RESERVE = {"cuda": 2 << 30, "cpu": 512 * _MIB}


def activation_reserve(
    device: torch.device, max_num_seqs: int, step_tokens: int | None, vocab_size: int
) -> int:
    """Bytes kept free beside the KV pool: the largest decode batch's fp32 logits twice, and a
    margin for everything else a step allocates. On CUDA the graphs hold logits for
    `max_num_seqs` rows; elsewhere a step has at most `step_tokens` rows (the step budget)."""
    rows = max_num_seqs
    if device.type != "cuda" and step_tokens is not None:
        rows = min(rows, step_tokens)
    return rows * vocab_size * 4 * 2 + _RESERVE.get(device.type, _RESERVE["cpu"])


def available_bytes(device: torch.device) -> int | None:
    """Bytes this process can still allocate on `device`; None where that cannot be known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    limits = [x for x in (_meminfo_available(), _cgroup_headroom()) if x is not None]
    return min(limits) if limits else None


def check_kv_pool_fits(pool_bytes: int, reserve: int, device: torch.device, ranks: int = 1) -> None:
    """Refuse a KV pool that, with `reserve` beside it, is more than `device` has left; `ranks`
    processes of a tensor-parallel group that share the device each hold one."""
    available = available_bytes(device)
    if available is None or (pool_bytes + reserve) * ranks <= available:
        return
    room = (available // ranks - reserve) // _MIB
    each = f" for each of {ranks} ranks" if ranks > 1 else ""
    if room <= 0:
        raise InvalidRequest(
            "max_num_seqs",
            f"the weights leave {available // _MIB:,} MiB free on {device.type}: not enough for "
            f"the {reserve // _MIB:,} MiB{each} kept for activations, KV cache aside; "
            "serve fewer sequences a step (--max-num-seqs) or free memory",
        )
    raise InvalidRequest(
        "kv_cache_mb",
        f"a KV cache of {pool_bytes // _MIB:,} MiB{each} does not fit on {device.type}: "
        f"{available // _MIB:,} MiB are free after the weights and {reserve // _MIB:,} MiB{each} "
        f"stay free for activations; give --kv-cache-mb {room} or less",
    )


def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """A container's limit less its use (cgroup v2), where /proc/meminfo shows the host's. Its
    inactive page cache counts as free: the kernel gives it up before the container's OOM."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int((root / "memory.current").read_text())
        stat = dict(line.split() for line in (root / "memory.stat").read_text().splitlines())
        return max(0, int(limit) - used + int(stat.get("inactive_file", 0)))
    except (OSError, ValueError):
        return None


def huge_page_buffer(nbytes: int, what: str) -> torch.Tensor:
    """nbytes of CPU memory (uint8, untouched) starting on a 2 MiB boundary, asked to be backed
    by transparent huge pages (Linux; elsewhere, or where refused, plain pages; `what` names it
    in the log). Memory read in long runs from scattered places (the weights, a sequence's KV
    blocks) then misses the TLB far less: a single core read scattered 24 KB blocks 25% faster
    (bench/RESULTS-cpu.md)."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched: no page exists yet
    start = -raw.data_ptr() % HUGE_PAGE
    buffer = raw[start : start + nbytes]
    whole_pages = nbytes // HUGE_PAGE * HUGE_PAGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(buffer.data_ptr()), whole_pages, MADV_HUGEPAGE) != 0:
            log.info("huge pages refused for %s (errno %d)", what, ctypes.get_errno())
    except (OSError, AttributeError):
        pass
    return buffer

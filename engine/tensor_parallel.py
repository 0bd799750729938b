"""A tensor-parallel group as the model's layers see it: this rank, the world, two collectives.

At world size 1 (`SINGLE`) it is inert: nothing is sharded and no collective is called, so a
one-process engine runs exactly as it did before tensor parallelism existed. Above it, the
group wraps a `torch.distributed` process group: NCCL on CUDA (all-reduce and all-gather inside
captured CUDA graphs), gloo on CPU. Which rank holds which weights is engine/shard.py's business;
the layers that call these collectives are engine/parallel_layers.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"  # a rank group lives on one host: its rendezvous never leaves it
# all_gather_single is torch 2.13's name (all_gather_into_tensor deprecated there); the GPU
# image's torch 2.11 has only the older one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # the torch.distributed ProcessGroup; None at world size 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in place."""
        if self.sharded:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(N, W) on each rank → (N, world_size * W), rank 0's columns first."""
        if not self.sharded:
            return x
        n, w = x.shape
        out = torch.empty((self.world_size * n, w), dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous(), group=self.group)
        # (world, N, W) → (N, world, W) → (N, world * W)
        return out.view(self.world_size, n, w).transpose(0, 1).reshape(n, self.world_size * w)

    def min(self, value: int) -> int:
        """The smallest of every rank's value (outside the hot path: it syncs with the host)."""
        if not self.sharded:
            return value
        nccl = dist.get_backend(self.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = TensorParallel()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Where rank `rank` runs: on CUDA the device `device.index + rank`, one GPU a rank."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def rendezvous(rank: int, world_size: int, port: int, timeout_s: float) -> dist.TCPStore:
    """The store the group meets at: rank 0 hosts it on `port` of the loopback (0: a free port,
    then `.port`), the others connect to it."""
    return dist.TCPStore(
        LOOPBACK,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join(
    rank: int, world_size: int, store: dist.Store, device: torch.device, timeout_s: float
) -> TensorParallel:
    """Join the group meeting at `store`, on this rank's device (`rank_device`). timeout_s
    bounds every collective: the last resort against a hang (a dead rank is noticed sooner:
    engine/rank_group.py)."""
    if device.type == "cuda":
        # NVLink multicast (NVLS) off: on shared hosts a program using it can take the GPUs
        # out of service. An explicit setting in the environment stands.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank_device(device, rank))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return TensorParallel(rank, world_size, dist.group.WORLD)


def leave(tp: TensorParallel) -> None:
    if tp.sharded and dist.is_initialized():
        dist.destroy_process_group()

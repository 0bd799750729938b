"""An engine spread over a tensor-parallel group: rank 0 in the caller's process, ranks 1..N-1
in processes it starts, all stepping in lockstep.

    engine = start_engine(EngineArgs(path, device="cuda", dtype="bfloat16"), 2)
    outputs = engine.step(batch)  # the Engine contract, unchanged
    engine.close()                # stops the other ranks

Rank 0 is the engine its caller knows. Each `step` and `release` goes first to the other ranks
(engine/step_channel.py), then rank 0 runs it; every rank runs the same forward, whose
collectives keep them in step, and only rank 0's outputs leave. A follower runs exactly what
rank 0 runs, so errors a step raises (a bad request) are raised on every rank alike, before any
collective, and the group goes on.

Dying together: a follower's watchdog thread ends it when rank 0's process ends, however that
ends. Rank 0 watches its followers' process sentinels from a thread: from the moment one has
died every `step` and `release` raises RankGroupError naming it. A step already waiting on the
dead rank fails at once on gloo (its peer's socket closes); on NCCL, whose kernels would wait
for ever (and inside a CUDA graph no watchdog sees them), the thread aborts the process group
so that they return. The group's timeout bounds every collective besides, the last resort
against a rank that hangs alive. A group is not mended: its owner closes it and starts another.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnProcess
from pathlib import Path

import torch
import torch.distributed as dist

from engine.batch import SeqInput
from engine.engine import Engine, parse_device
from engine.errors import EngineError, InvalidRequest, RankGroupError
from engine.step_channel import StepChannel
from engine.tensor_parallel import SINGLE, TensorParallel, join, leave, rendezvous

log = logging.getLogger(__name__)

STEP, RELEASE, STOP = "step", "release", "stop"
STOP_GRACE_S = 10.0  # a follower told to stop has this long before it is killed


@dataclass(frozen=True)
class EngineArgs:
    """Engine.from_path's parameters as one value, which every rank of a group loads from."""

    path: Path
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_bytes: int = 1 << 30  # per rank: a rank's KV blocks hold its KV heads only
    block_size: int = 16
    quantize: str = "auto"
    max_num_seqs: int = 256
    cuda_graphs: bool = True
    gpu_memory_fraction: float = 0.9
    warm_up_tokens: int | None = 2048
    progress: bool = True
    kv_cache_dtype: str = "auto"
    max_model_len: int = 0  # the longest sequence served; 0: the model's context
    # Torch threads of each other rank on CPU; None: the cores shared evenly among the ranks.
    follower_threads: int | None = None
    # Bounds every collective, the last resort against a rank that hangs without dying (a dead
    # one is noticed at once); generous, since ranks wait on each other while they load.
    timeout_s: float = 600.0


def start_engine(args: EngineArgs, tensor_parallel_size: int = 1) -> Engine:
    """An engine on `tensor_parallel_size` ranks (1: this process alone, no group)."""
    n = tensor_parallel_size
    if n < 1:
        raise InvalidRequest("tensor_parallel_size", f"must be at least 1, got {n}")
    if n == 1:
        return _load(args, SINGLE)
    device = parse_device(args.device)
    if device.type == "cuda" and (device.index or 0) + n > torch.cuda.device_count():
        raise InvalidRequest(
            "tensor_parallel_size",
            f"{n} ranks need {n} GPUs from {device}; this host has {torch.cuda.device_count()}",
        )
    store = rendezvous(0, n, 0, args.timeout_s)
    ctx = multiprocessing.get_context("spawn")
    channel = StepChannel(ctx, n - 1)
    followers, joining = [], []
    for rank in range(1, n):
        mine, theirs = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_follow,
            args=(args, rank, n, store.port, channel, theirs),
            name=f"tandem-tp-rank{rank}",
            daemon=True,  # ended at this process's exit too (not only by the watchdog)
        )
        process.start()
        theirs.close()
        followers.append(process)
        joining.append(mine)
    group = RankGroup(followers, channel)
    try:
        group.wait_joining(joining)
        tp = join(0, n, store, device, args.timeout_s)
        group.tp = tp
        engine = _load(replace(args, warm_up_tokens=None), tp)
        engine.followers = group
        if args.warm_up_tokens is not None and engine.device.type == "cuda":
            engine.warm_up(args.warm_up_tokens)
    except BaseException as err:
        try:
            if not isinstance(err, EngineError):
                group.check(err)  # a collective failed because a rank died: say which
        finally:
            group.close()
        raise
    return engine


def _load(args: EngineArgs, tp: TensorParallel) -> Engine:
    kwargs = {f.name: getattr(args, f.name) for f in fields(args)}
    del kwargs["follower_threads"], kwargs["timeout_s"]  # the group's, not the engine's
    kwargs["progress"] = args.progress and tp.rank == 0
    return Engine.from_path(**kwargs, tp=tp)


class RankGroup:
    """Rank 0's side of the group: the followers' processes, the channel to them, and the
    thread that notices their deaths. Engine's `Followers`."""

    def __init__(self, followers: list[SpawnProcess], channel: StepChannel) -> None:
        self.followers = followers
        self.writer = channel.writer(self.check)
        self.tp: TensorParallel | None = None  # set once rank 0 has joined
        self.dead: str | None = None  # what RankGroupError says, once a follower has died
        self.died = threading.Event()
        self.closing = False
        threading.Thread(target=self._watch, name="tandem-tp-watch", daemon=True).start()

    def wait_joining(self, joining: list[Connection]) -> None:
        """Until every follower is about to join the process group, or one has died."""
        pending = list(joining)
        sentinels = [p.sentinel for p in self.followers]
        while pending:
            for ready in wait([*pending, *sentinels]):
                if ready in pending:
                    pending.remove(ready)
                    try:
                        ready.recv()
                        continue
                    except EOFError:
                        pass  # it died before it could say so
                self.died.wait()  # the watching thread is naming the dead rank
                self.check()

    def send_step(self, batch: Sequence[SeqInput]) -> None:
        self.check()
        self.writer.put((STEP, batch))

    def send_release(self, seq_ids: list[Hashable]) -> None:
        self.check()
        self.writer.put((RELEASE, seq_ids))

    def check(self, cause: BaseException | None = None) -> None:
        """Raise RankGroupError if a rank has died. `cause`: what rank 0's call raised. An
        EngineError (a bad request) is raised on every rank before any collective, and the
        group goes on; anything else may have left rank 0 short of collectives the others are
        waiting in, so the ranks are out of step for good (unless a dead rank explains it)."""
        if self.dead is None and cause is not None and not isinstance(cause, EngineError):
            self.died.wait(timeout=2.0)  # a rank that just died is being noticed
            if self.dead is None:
                self.dead = (
                    f"rank 0 failed mid-step ({type(cause).__name__}), leaving the other ranks "
                    "out of step: close the group and start another"
                )
        if self.dead is not None:
            raise RankGroupError(self.dead) from cause

    def wait_lost(self) -> str:
        self.died.wait()
        return self.dead or "the group was lost"

    def close(self) -> None:
        """Stop the followers (a grace period, then killed) and leave the group. Idempotent."""
        if self.closing:
            return
        self.closing = True
        if self.dead is None:
            # One that died just now, or is stuck, is not told: it is killed below.
            with contextlib.suppress(RankGroupError, TimeoutError):
                self.writer.put((STOP, None), STOP_GRACE_S)
        for process in self.followers:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                log.warning("rank %s did not stop in %.0f s: killed", process.name, STOP_GRACE_S)
                process.kill()
                process.join()
        if self.tp is not None:
            leave(self.tp)

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.followers, start=1)}
        ready = wait(list(sentinels))
        if self.closing:
            return
        rank, process = next(who for sentinel, who in sentinels.items() if sentinel in ready)
        process.join()
        self.dead = (
            f"tensor-parallel rank {rank} of {len(self.followers) + 1} (pid {process.pid}) "
            f"{_how(process.exitcode)}: the group cannot step; close it and start another"
        )
        log.error("%s", self.dead)
        self.died.set()
        tp = self.tp
        if tp is not None and dist.get_backend(tp.group) == "nccl":
            # Collectives waiting on the dead rank would never return: abort them.
            try:
                dist.distributed_c10d._abort_process_group(tp.group)
            except Exception:  # the error above stands either way
                log.exception("aborting the NCCL process group failed")


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _follow(
    args: EngineArgs,
    rank: int,
    world_size: int,
    port: int,
    channel: StepChannel,
    joining: Connection,
) -> None:
    """A follower's whole life: join, load its shard, then run what rank 0 sends until STOP."""
    _die_with_parent()
    device = parse_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.follower_threads or max(1, (os.cpu_count() or 1) // world_size))
    store = rendezvous(rank, world_size, port, args.timeout_s)
    joining.send(rank)
    tp = join(rank, world_size, store, device, args.timeout_s)
    engine = _load(replace(args, warm_up_tokens=None), tp)
    engine.guides = None  # its samples are dropped (rank 0's are the step's): see _unheld
    # As rank 0's process does once it serves (services/process.py): a full collection's walk
    # over all that loading made would stall every collective of the group.
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    reader = channel.reader(rank - 1)
    while True:
        kind, payload = reader.get()
        if kind == STOP:
            break
        if kind == RELEASE:
            engine.release(payload)
            continue
        # A bad request: rank 0 raised it too, before any collective, and told its caller.
        with contextlib.suppress(EngineError):
            engine.step(_unheld(payload))
    leave(tp)


def _unheld(batch: list[SeqInput]) -> list[SeqInput]:
    """`batch` with no grammar: a follower's sample is dropped, so it need not follow one (nor
    read the vocabulary to). Sampling comes after the step's collectives, which stay the same."""
    return [
        replace(s, sampling=replace(s.sampling, grammar="")) if s.sampling.grammar else s
        for s in batch
    ]


def _die_with_parent() -> None:
    """End this process as soon as the process that started it (rank 0) has ended."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="tandem-tp-parent", daemon=True).start()

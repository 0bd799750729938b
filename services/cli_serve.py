"""`tandem serve`: the whole pipeline on this machine — worker, scheduler and tokenizers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from engine import registry

if TYPE_CHECKING:
    from services.launcher import ProcessSpec


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="start the tokenizer, scheduler and worker processes and serve the gRPC API",
        description="Start the pipeline locally: one worker, one scheduler and N tokenizers, "
        "supervised (a crashed process is restarted) until Ctrl-C or SIGTERM.",
    )
    p.add_argument(
        "--model",
        default=registry.DEFAULT_MODEL,
        help=f"model name or path (default {registry.DEFAULT_MODEL})",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--host", default="127.0.0.1", help="public address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="public port (default 50051)")
    p.add_argument("--tokenizers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="new tokens per step")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="waiting requests beyond which new ones get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-wait-us",
        type=float,
        default=0.0,
        help="micro-batch window while the worker is idle (0: off)",
    )
    p.add_argument("--kv-cache-mb", type=int, default=1024, help="KV cache memory in MiB")
    p.add_argument(
        "--transport",
        choices=["shm", "grpc"],
        default="shm",
        help="hot path through shared memory (default) or gRPC",
    )
    p.add_argument("--scheduler-port", type=int, default=0, help="internal (0: any free port)")
    p.add_argument("--worker-port", type=int, default=0, help="internal (0: any free port)")
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds each process may take to become healthy",
    )
    p.add_argument(
        "--demo",
        metavar="PROMPT",
        help="once serving, stream a reply to this chat prompt (what `make run` does)",
    )
    p.set_defaults(func=_serve)


def _specs(args: argparse.Namespace) -> list[ProcessSpec]:
    from services.launcher import ProcessSpec, free_port

    worker_port = args.worker_port or free_port()
    scheduler_port = args.scheduler_port or free_port()
    common = ["--model", args.model, "--home", str(args.home)]
    specs = [
        ProcessSpec(
            "worker",
            "services.worker",
            [
                *common,
                "--port",
                str(worker_port),
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                "--kv-cache-mb",
                str(args.kv_cache_mb),
            ],
            f"127.0.0.1:{worker_port}",
            stop_grace_s=10.0,
        ),
        ProcessSpec(
            "scheduler",
            "services.scheduler",
            [
                "--port",
                str(scheduler_port),
                "--worker",
                f"127.0.0.1:{worker_port}",
                "--transport",
                args.transport,
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
                "--max-queued-requests",
                str(args.max_queued_requests),
                "--max-wait-us",
                str(args.max_wait_us),
            ],
            f"127.0.0.1:{scheduler_port}",
            stop_grace_s=10.0,
        ),
    ]
    for i in range(1, args.tokenizers + 1):
        admin = free_port()
        specs.append(
            ProcessSpec(
                f"tokenizer-{i}",
                "services.tokenizer",
                [
                    *common,
                    "--host",
                    args.host,
                    "--port",
                    str(args.port),
                    "--admin-port",
                    str(admin),
                    "--scheduler",
                    f"127.0.0.1:{scheduler_port}",
                    "--transport",
                    args.transport,
                ],
                f"127.0.0.1:{admin}",
                stop_grace_s=15.0,
            )
        )
    return specs


def _serve(args: argparse.Namespace) -> int:
    # The launcher forks its children while gRPC (health checks) runs in it: skip grpc's fork
    # handlers, which the children never need (they exec a fresh interpreter).
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from services.server import run, setup_logging

    if args.tokenizers < 1:
        print("tandem serve: error: --tokenizers must be at least 1", file=sys.stderr)
        return 2
    registry.resolve(args.model, args.home)  # fetch a named model once, before any process starts
    setup_logging("launcher")
    return run(lambda: _supervise(args))


async def _supervise(args: argparse.Namespace) -> int:
    from services.launcher import LaunchFailed, Supervisor, child_env

    log = logging.getLogger("tandem.launcher")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    supervisor = Supervisor(_specs(args), child_env(), args.ready_timeout)
    try:
        starting = asyncio.create_task(supervisor.start_all())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            starting.cancel()
            return 130
        starting.result()
        address = f"{args.host}:{args.port}"
        print(
            f"tandem serving {args.model} at {address} "
            f"({args.tokenizers} tokenizer(s), device {args.device})",
            flush=True,
        )
        if args.demo:
            await _demo(address, args.demo)
        await stop.wait()
        log.info("shutting down")
        return 0
    except LaunchFailed as err:
        log.error("%s", err)
        return 1
    finally:
        await supervisor.stop_all()


async def _demo(address: str, prompt: str) -> None:
    from grpc import aio

    from tandem.v1 import generation_pb2 as pb
    from tandem.v1 import generation_pb2_grpc

    request = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
        max_tokens=128,
        sampling=pb.SamplingParams(temperature=0.0),
    )
    print(f"\n> {prompt}\n", flush=True)
    async with aio.insecure_channel(address) as channel:
        async for reply in generation_pb2_grpc.GenerationStub(channel).Generate(request):
            sys.stdout.write(reply.text)
            sys.stdout.flush()
            if reply.finish_reason:
                print(
                    f"\n\n[{reply.usage.completion_tokens} tokens, {reply.finish_reason}] "
                    "still serving; Ctrl-C stops",
                    flush=True,
                )

"""python -m services.worker: load the model and serve steps to a scheduler."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from engine import registry
from engine.errors import EngineError
from services.cli_args import add_engine_args, dtype_for
from services.server import run, setup_logging, start_server, stop_event_on_signals
from services.telemetry import config as telemetry_config
from services.telemetry.config import TelemetryConfig
from services.worker.config import WorkerConfig
from tandem.internal.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("tandem.worker")


def parse_args(argv: list[str] | None = None) -> tuple[WorkerConfig, TelemetryConfig]:
    parser = argparse.ArgumentParser(prog="python -m services.worker", description=__doc__)
    parser.add_argument(
        "--model",
        default=os.environ.get("TANDEM_MODEL", registry.DEFAULT_MODEL),
        help="model name or path (env TANDEM_MODEL)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback default)")
    parser.add_argument("--port", type=int, default=50053)
    add_engine_args(parser)
    parser.add_argument(
        "--kv-cache-mb",
        type=int,
        default=1024,
        help="KV cache memory in MiB (0 on CUDA: what the weights leave of --gpu-memory-fraction)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="largest batch (sizes CUDA graphs)"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs for decode steps"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="CPU threads for batched steps and prefills (default: all cores); small decode "
        "steps leave one core to the tokenizer and scheduler (services/worker/threads.py)",
    )
    parser.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.9,
        help="share of the GPU's memory for weights, activations and KV cache",
    )
    parser.add_argument(
        "--home",
        type=Path,
        default=Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser(),
    )
    env = dict(os.environ)
    telemetry_config.add_arguments(parser, env, "worker")
    args = parser.parse_args(argv)
    worker = WorkerConfig(
        model_path=registry.resolve(args.model, args.home),
        model_name=args.model,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=dtype_for(args.device, args.dtype),
        kv_cache_bytes=args.kv_cache_mb << 20,
        block_size=args.block_size,
        quantize=args.quantize,
        max_num_seqs=args.max_num_seqs,
        cuda_graphs=not args.enforce_eager,
        gpu_memory_fraction=args.gpu_memory_fraction,
        threads=args.threads,
    )
    return worker, telemetry_config.from_args(args, env)


async def serve(config: WorkerConfig, telemetry: TelemetryConfig) -> int:
    import torch

    from engine.engine import Engine
    from services.telemetry.metrics_server import MetricsServer
    from services.telemetry.step_telemetry import StepTelemetry
    from services.telemetry.tracing import Tracing
    from services.telemetry.worker_metrics import WorkerMetrics
    from services.worker.service import WorkerServicer
    from services.worker.threads import ThreadPolicy
    from shm.reader import Reader
    from shm.reaper import reap

    torch.set_num_threads(config.threads)
    stop = stop_event_on_signals()
    reap()  # what crashed processes left in a shared /dev/shm (e.g. across containers)
    tracing = Tracing.start(telemetry)
    metrics = WorkerMetrics(config.model_name)
    engine = Engine.from_path(
        config.model_path,
        config.device,
        config.dtype,
        config.kv_cache_bytes,
        config.block_size,
        progress=False,
        quantize=config.quantize,
        max_num_seqs=config.max_num_seqs,
        cuda_graphs=config.cuda_graphs,
        gpu_memory_fraction=config.gpu_memory_fraction,
    )
    reader = Reader()
    threads = (
        ThreadPolicy(config.threads, os.cpu_count() or 1) if engine.device.type == "cpu" else None
    )
    servicer = WorkerServicer(
        engine, config.model_name, reader, StepTelemetry(tracing, metrics), threads
    )
    metrics_server = MetricsServer.start(
        telemetry.metrics_host, telemetry.metrics_port, metrics.registry
    )
    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
    server = await start_server(
        config.address,
        lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
        [service],
    )
    log.info(
        "worker serving %s on port %d (%d KV blocks of %d; projections as %s)",
        config.model_name,
        server.port,
        engine.num_kv_blocks,
        engine.block_size,
        engine.loaded.linear_format,
    )
    await stop.wait()
    log.info("stopping")
    await server.set_serving(False)
    servicer.stop_loop()
    await server.stop(grace=2.0)
    reader.close()
    if metrics_server is not None:
        metrics_server.stop()
    await asyncio.to_thread(tracing.shutdown)
    return 0


def main(argv: list[str] | None = None) -> int:
    setup_logging("worker")
    try:
        config, telemetry = parse_args(argv)
    except (EngineError, ValueError) as err:
        print(f"worker: error: {err}", file=sys.stderr)
        return 2
    return run(lambda: serve(config, telemetry))


if __name__ == "__main__":
    sys.exit(main())

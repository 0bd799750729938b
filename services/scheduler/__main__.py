"""python -m services.scheduler: plan steps for a worker and stream tokens to tokenizers."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass

from services.scheduler.config import SchedulerConfig
from services.server import run, setup_logging, start_server, stop_event_on_signals
from services.telemetry import config as telemetry_config
from services.telemetry.config import TelemetryConfig
from tandem.internal.v1 import hotpath_pb2 as hp
from tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("tandem.scheduler")


@dataclass(frozen=True)
class SchedulerProcessConfig:
    host: str
    port: int
    worker: str
    shared_memory: bool
    policy: dict[str, object]  # SchedulerConfig fields other than the KV pool's
    telemetry: TelemetryConfig

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def scheduler_config(self, model: hp.ModelDescription) -> SchedulerConfig:
        return SchedulerConfig(
            num_kv_blocks=model.num_kv_blocks,
            block_size=model.block_size,
            max_model_len=model.max_seq_len,
            **self.policy,  # type: ignore[arg-type]
        )


def parse_args(argv: list[str] | None = None) -> SchedulerProcessConfig:
    defaults = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
    parser = argparse.ArgumentParser(prog="python -m services.scheduler", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback default)")
    parser.add_argument("--port", type=int, default=50052)
    parser.add_argument("--worker", default="127.0.0.1:50053", help="the worker's gRPC address")
    parser.add_argument(
        "--transport",
        choices=["shm", "grpc"],
        default="shm",
        help="hot path to the worker: shared-memory rings (same host) or gRPC (another host)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=defaults["max_num_seqs"], help="sequences per step"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults["max_num_batched_tokens"],
        help="new tokens per step",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults["max_waiting_requests"],
        help="waiting requests beyond which submissions get RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--max-wait-us",
        type=float,
        default=defaults["max_wait_us"],
        help="micro-batch window while the worker is idle (0: off)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--aging-per-s",
        type=float,
        default=defaults["aging_per_s"],
        help="priority levels a waiting request gains per second",
    )
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="plan each step only after the previous one's outcome (by default the next step "
        "is planned while the worker runs the current one)",
    )
    env = dict(os.environ)
    telemetry_config.add_arguments(parser, env, "scheduler")
    args = parser.parse_args(argv)
    policy = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_waiting_requests": args.max_queued_requests,
        "max_wait_us": args.max_wait_us,
        "enable_prefix_caching": not args.no_prefix_caching,
        "aging_per_s": args.aging_per_s,
        "async_scheduling": not args.no_async_scheduling,
    }
    # Validate the policy now, with a stand-in pool, so bad flags fail before any connecting.
    SchedulerConfig(num_kv_blocks=1, block_size=16, max_model_len=1 << 20, **policy)
    return SchedulerProcessConfig(
        host=args.host,
        port=args.port,
        worker=args.worker,
        shared_memory=args.transport == "shm",
        policy=policy,
        telemetry=telemetry_config.from_args(args, env),
    )


async def serve(config: SchedulerProcessConfig) -> int:
    from services.scheduler.loop import StepLoop
    from services.scheduler.routes import Routes
    from services.scheduler.service import SchedulerServicer
    from services.scheduler.worker_link import WorkerLink
    from services.telemetry.metrics_server import MetricsServer
    from services.telemetry.scheduler_metrics import SchedulerMetrics
    from services.telemetry.scheduler_telemetry import SchedulerTelemetry
    from services.telemetry.tracing import Tracing
    from shm.reader import Reader
    from shm.reaper import reap

    stop = stop_event_on_signals()
    reap()  # what crashed processes of an earlier run left in /dev/shm
    tracing = Tracing.start(config.telemetry)
    metrics = SchedulerMetrics()
    metrics_server = MetricsServer.start(
        config.telemetry.metrics_host, config.telemetry.metrics_port, metrics.registry
    )
    reader = Reader()
    loop = StepLoop(
        WorkerLink(config.worker, config.shared_memory),
        Routes(),
        config.scheduler_config,
        SchedulerTelemetry(tracing, metrics),
    )
    servicer = SchedulerServicer(loop, reader, int(config.policy["max_waiting_requests"]))  # type: ignore[call-overload]
    service = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
    server = await start_server(
        config.address,
        lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, s),
        [service],
        serving=False,
        interceptors=tracing.server_interceptors,
    )
    log.info("scheduler on port %d, waiting for the worker at %s", server.port, config.worker)
    await loop.start()
    await server.set_serving(True)
    await stop.wait()
    log.info("stopping")
    await server.set_serving(False)
    await server.stop(grace=5.0)
    await loop.stop()
    reader.close()
    if metrics_server is not None:
        metrics_server.stop()
    await asyncio.to_thread(tracing.shutdown)
    return 0


def main(argv: list[str] | None = None) -> int:
    setup_logging("scheduler")
    try:
        config = parse_args(argv)
    except ValueError as err:
        print(f"scheduler: error: {err}", file=sys.stderr)
        return 2
    return run(lambda: serve(config))


if __name__ == "__main__":
    sys.exit(main())

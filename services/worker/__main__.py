"""python -m services.worker: load the model and serve steps to a scheduler."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from services.process import Service, main, run_service, settings_of
from services.telemetry.tracing import Tracing
from services.worker.config import WorkerConfig

log = logging.getLogger("tandem.worker")


def parse_args(argv: Sequence[str] | None = None) -> WorkerConfig:
    return settings_of("worker", WorkerConfig, argv, __doc__ or "")


async def serve(config: WorkerConfig) -> int:
    async def build(tracing: Tracing) -> Service:
        import torch

        from engine import registry
        from engine.engine import Engine
        from services.telemetry.worker_metrics import WorkerMetrics
        from services.telemetry.worker_telemetry import WorkerTelemetry
        from services.worker.service import WorkerServicer
        from services.worker.threads import ThreadPolicy
        from shm.reader import Reader
        from tandem.internal.v1 import worker_pb2, worker_pb2_grpc

        e, model = config.engine, config.model
        threads = e.threads or os.cpu_count() or 1
        torch.set_num_threads(threads)
        metrics = WorkerMetrics(model.model)
        engine = Engine.from_path(
            registry.resolve(model.model, Path(model.home).expanduser()),
            e.device,
            e.resolved_dtype,
            e.kv_cache_mb << 20,
            e.block_size,
            progress=False,
            quantize=e.quantize,
            max_num_seqs=config.max_num_seqs,
            cuda_graphs=not e.enforce_eager,
            warm_up_tokens=config.max_num_batched_tokens,
            gpu_memory_fraction=e.gpu_memory_fraction,
        )
        log.info(
            "serving %s (%d KV blocks of %d; projections as %s)",
            model.model,
            engine.num_kv_blocks,
            engine.block_size,
            engine.loaded.linear_format,
        )
        reader = Reader()
        policy = ThreadPolicy(threads, os.cpu_count() or 1) if engine.device.type == "cpu" else None
        servicer = WorkerServicer(
            engine, model.model, reader, WorkerTelemetry(tracing, metrics), policy
        )

        async def stop() -> None:
            servicer.stop_loop()
            reader.close()

        return Service(
            register=lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
            service_names=[worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
            metrics=metrics.registry,
            stop=stop,
            grace_s=2.0,
            tls=config.tls,
        )

    return await run_service("worker", config.address, config.telemetry, build)


if __name__ == "__main__":
    sys.exit(main("worker", WorkerConfig, serve, __doc__))

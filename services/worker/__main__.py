"""python -m services.worker: load the model and serve steps to a scheduler."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from services.process import Service, main, run_service, settings_of
from services.telemetry.tracing import Tracing
from services.worker.config import WorkerConfig
from services.worker.runner import exit_group_lost

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger("tandem.worker")


def parse_args(argv: Sequence[str] | None = None) -> WorkerConfig:
    return settings_of("worker", WorkerConfig, argv, __doc__ or "")


async def serve(config: WorkerConfig) -> int:
    async def build(tracing: Tracing) -> Service:
        import torch

        from engine import registry
        from engine.rank_group import start_engine
        from services.worker.metrics import WorkerMetrics
        from services.worker.service import WorkerServicer
        from services.worker.telemetry import WorkerTelemetry
        from services.worker.threads import ThreadPolicy
        from shm.reader import Reader
        from tandem.internal.v1 import worker_pb2, worker_pb2_grpc

        e, model = config.engine, config.model
        threads = e.threads or os.cpu_count() or 1
        if e.tensor_parallel_size > 1 and e.device == "cpu":
            threads = max(1, threads // e.tensor_parallel_size)  # the cores, shared by the ranks
        torch.set_num_threads(threads)
        metrics = WorkerMetrics(model.model)
        path = registry.resolve(model.model, Path(model.home).expanduser())
        args = e.engine_args(path, config.max_num_seqs, config.max_num_batched_tokens)
        engine = start_engine(args, e.tensor_parallel_size)
        if e.tensor_parallel_size > 1:
            threading.Thread(target=_exit_when_lost, args=(engine,), daemon=True).start()
        log.info(
            "serving %s (%d KV blocks of %d; projections as %s)",
            model.model,
            engine.num_kv_blocks,
            engine.block_size,
            engine.loaded.linear_format,
        )
        kv_tokens, context = engine.num_kv_blocks * engine.block_size, engine.config.max_seq_len
        if kv_tokens < context:  # the scheduler refuses longer requests, each with a message
            log.warning(
                "the KV cache holds %d tokens, less than one full context of %d: requests whose "
                "prompt and max_tokens need more are refused (--kv-cache-mb sets its size)",
                kv_tokens,
                context,
            )
        _read_vocabulary(engine)
        reader = Reader()
        policy = ThreadPolicy(threads, os.cpu_count() or 1) if engine.device.type == "cpu" else None
        overlap = e.overlap_steps and engine.device.type == "cuda" and engine.followers is None
        telemetry = WorkerTelemetry(tracing, metrics)
        servicer = WorkerServicer(engine, model.model, reader, telemetry, policy, overlap)

        async def stop() -> None:
            servicer.stop_loop()
            reader.close()
            engine.close()

        return Service(
            register=lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
            service_names=[worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
            metrics=metrics.registry,
            stop=stop,
            grace_s=2.0,
            tls=config.tls,
        )

    return await run_service("worker", config.address, config.telemetry, build)


def _read_vocabulary(engine: Engine) -> None:
    """The vocabulary grammars are followed with, read before serving: read at the first request
    with an output format, it held every running sequence's next step for seconds."""
    from engine.errors import EngineError

    if engine.guides is None:
        return
    started = time.perf_counter()
    try:
        engine.guides.warm()
    except EngineError as err:
        engine.guides = None  # requests with an output format are refused, saying so
        log.warning("no output formats: the model's tokenizer cannot be read (%s)", err)
        return
    log.info("vocabulary for output formats read in %.1f s", time.perf_counter() - started)


def _exit_when_lost(engine: Engine) -> None:
    why = engine.wait_lost()
    if why is not None:
        exit_group_lost(engine, why)


if __name__ == "__main__":
    sys.exit(main("worker", WorkerConfig, serve, __doc__))

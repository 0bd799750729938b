"""python -m services.scheduler: plan steps for a worker and stream tokens to tokenizers."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.process import Service, channel_credentials, main, run_service, settings_of
from services.scheduler.config import SchedulerConfig, SchedulerProcessConfig
from services.telemetry.tracing import Tracing


def parse_args(argv: Sequence[str] | None = None) -> SchedulerProcessConfig:
    return settings_of("scheduler", SchedulerProcessConfig, argv, __doc__ or "")


async def serve(config: SchedulerProcessConfig) -> int:
    async def build(tracing: Tracing) -> Service:
        from services.scheduler.loop import StepLoop
        from services.scheduler.metrics import SchedulerMetrics
        from services.scheduler.routes import Routes
        from services.scheduler.service import SchedulerServicer
        from services.scheduler.telemetry import SchedulerTelemetry
        from services.scheduler.worker_link import WorkerLink
        from shm.reader import Reader
        from tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

        metrics = SchedulerMetrics()
        reader = Reader()
        loop = StepLoop(
            WorkerLink(
                config.worker,
                config.transport == "shm",
                channel_credentials(config.tls) if config.tls.secures(config.worker) else None,
                config.policy.max_num_seqs,
            ),
            Routes(),
            lambda model: SchedulerConfig.for_worker(config.policy, model),
            SchedulerTelemetry(tracing, metrics),
        )
        servicer = SchedulerServicer(loop, reader, config.policy.max_queued_requests)

        async def stop() -> None:
            await loop.stop()
            reader.close()

        return Service(
            register=lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, s),
            service_names=[scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name],
            metrics=metrics.registry,
            start=loop.start,
            stop=stop,
            tls=config.tls,
        )

    return await run_service("scheduler", config.address, config.telemetry, build)


if __name__ == "__main__":
    sys.exit(main("scheduler", SchedulerProcessConfig, serve, __doc__))

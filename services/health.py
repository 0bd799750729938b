"""grpc's health service, as every process serves it."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer


class Health(HealthServicer):
    """grpc's health service, whose NOT_FOUND for a service it does not know says which (grpc's
    own gives no details)."""

    def __init__(self, services: Sequence[str]) -> None:
        super().__init__()
        self.services = frozenset(("", *services))

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self.services:
            known = ", ".join(repr(s) for s in sorted(self.services))
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"service {request.service!r} is not one of {known}"
            )
        return await super().Check(request, context)

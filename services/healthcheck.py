"""python -m services.healthcheck HOST:PORT: exit 0 when that process's gRPC health says SERVING.

What a container runtime runs as a health check (compose's `healthcheck`, Docker's
`HEALTHCHECK`): the images carry no grpc_health_probe binary, and this is the same standard
`grpc.health.v1.Health/Check` call. Exit codes are Docker's: 0 healthy, 1 unhealthy (2 is
reserved there, so a bad argument also exits 1).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str, timeout_s: float) -> tuple[bool, str]:
    """Whether `service` at `address` is SERVING, and a one-line reason to print."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            return False, f"{address}: {code.name if code else 'error'}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return status == "SERVING", f"{address}: {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.healthcheck", description=__doc__)
    parser.add_argument("address", help="HOST:PORT of a tandem process's gRPC server")
    parser.add_argument(
        "--service", default="", help="a service name to ask about (default: the whole process)"
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for a reply")
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help exits 0; argparse's usage errors would exit 2
        return 0 if done.code == 0 else 1
    healthy, reason = check(args.address, args.service, args.timeout)
    print(reason, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())

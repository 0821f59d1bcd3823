#!/usr/bin/env python3
"""A tiny grpc.health.v1 Check client for container health checks.

Exit status: 0 iff the server answers SERVING for the service name; 1 when it answers anything
else (NOT_SERVING, UNKNOWN, unknown service name); 2 when it cannot be reached in time or the
arguments are bad. Docker only distinguishes 0 from non-zero; the split is for people.

The address and service name default to $HISPARSE_HEALTH_ADDRESS and $HISPARSE_HEALTH_SERVICE so
one image-level HEALTHCHECK serves every role: each compose service sets its own pair.
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_UNREACHABLE = 2


def channel_target(address: str) -> str:
    """A gRPC target from unix:///abs/path, unix:path, a bare /abs/path, or host:port."""
    if address.startswith("/"):
        return "unix://" + address
    return address


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="healthcheck.py",
        description="Ask a gRPC server for its grpc.health.v1 status. "
        "Exit 0 iff SERVING, 1 if it answers otherwise, 2 if unreachable.",
    )
    parser.add_argument(
        "address",
        nargs="?",
        default=os.environ.get("HISPARSE_HEALTH_ADDRESS"),
        help="unix:///path/to.sock, /path/to.sock or host:port (default: $HISPARSE_HEALTH_ADDRESS)",
    )
    parser.add_argument(
        "--service",
        "-s",
        default=os.environ.get("HISPARSE_HEALTH_SERVICE", ""),
        help='service name to check, e.g. kvcache.v1.KVCacheService; "" is the whole server '
        '(default: $HISPARSE_HEALTH_SERVICE or "")',
    )
    parser.add_argument(
        "--timeout",
        "-t",
        type=float,
        default=float(os.environ.get("HISPARSE_HEALTH_TIMEOUT", "3")),
        help="seconds to wait for the answer, connecting included (default: 3)",
    )
    parser.add_argument("--quiet", "-q", action="store_true", help="print nothing")
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("no address given and $HISPARSE_HEALTH_ADDRESS is not set")
    if not args.timeout > 0:
        parser.error("--timeout must be positive")
    return args


def check(address: str, service: str, timeout: float) -> tuple[int, str]:
    """One Check call: (exit status, what to print)."""
    # Imported here so --help and argument errors work even where grpc is missing.
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(channel_target(address)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            # wait_for_ready: a server still binding its socket counts as slow, not as dead,
            # until the timeout runs out.
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
            )
        except grpc.RpcError as err:
            code = err.code()
            if code == grpc.StatusCode.NOT_FOUND:
                return EXIT_NOT_SERVING, f"service {service!r} is unknown to {address}"
            return EXIT_UNREACHABLE, f"{address}: {code.name}: {err.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    return (EXIT_SERVING if ok else EXIT_NOT_SERVING), f"{address} {service!r}: {status}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    status, message = check(args.address, args.service, args.timeout)
    if not args.quiet:
        print(message, file=sys.stdout if status == EXIT_SERVING else sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())

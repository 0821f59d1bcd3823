"""Typed errors of the service, and the one mapping from an exception to a gRPC status.

Domain code (pool, core, remote swap) raises these; `interceptor.py` maps them for unary RPCs and
the Session stream maps them into in-band `Error` replies, both through `status_of`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from kv_service.layout import LayoutError

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """Base of every error a client may see. `details` are machine-readable numbers."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = {key: str(value) for key, value in details.items()}


class CapacityError(ServiceError):
    """Not enough free pages or request slots; details say how many were needed and free."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnknownRequest(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class UnknownSession(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    """A request id that is already live in the session."""

    code = grpc.StatusCode.ALREADY_EXISTS


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class WrongEpoch(ServiceError):
    """The client's epoch is from another service run: its mapped memory is stale."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(ServiceError):
    """The service is starting up and has no memory yet."""

    code = grpc.StatusCode.UNAVAILABLE


class Draining(Unavailable):
    """The service is shutting down and admits no new request."""


@dataclass(frozen=True)
class Status:
    code: grpc.StatusCode
    message: str
    details: dict[str, str]


def status_of(exc: BaseException) -> Status:
    """The gRPC status a client gets for `exc`. Unexpected exceptions become INTERNAL without
    leaking their text; they are logged here with the traceback."""
    if isinstance(exc, ServiceError):
        return Status(exc.code, exc.message, dict(exc.details))
    if isinstance(exc, LayoutError):
        return Status(grpc.StatusCode.INVALID_ARGUMENT, str(exc), {})
    log.error("internal error", exc_info=exc)
    return Status(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}", {})


DETAIL_PREFIX = "kv-detail-"


def trailing_metadata(status: Status) -> tuple[tuple[str, str], ...]:
    """Details travel as trailing metadata "kv-detail-<key>" on unary RPCs (the same keys as
    the in-band Error.details of the Session stream)."""
    return tuple((DETAIL_PREFIX + key.lower(), value)
                 for key, value in sorted(status.details.items()))

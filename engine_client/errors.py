"""Typed errors of the engine client, and the one mapping from gRPC status codes to them.

Every failure of the KV service reaches engine code as one of these classes: an `AioRpcError`
from a call, an in-band `Error` reply on the Session stream, or a lost connection. The mapping
lives here (`from_status`) so that `kv_client` translates errors in a single place and the
engine can decide by type: a `CapacityError` keeps a request queued, `ServiceUnavailable` fails
every running request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import grpc


class KVClientError(Exception):
    """Base of every error the engine client raises. `code` is the gRPC status it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, details: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, str] = dict(details or {})

    def __str__(self) -> str:
        if not self.details:
            return self.message
        extra = ", ".join(f"{k}={v}" for k, v in sorted(self.details.items()))
        return f"{self.message} ({extra})"


class ServiceUnavailable(KVClientError):
    """The KV service is gone, unreachable, draining, or did not answer within the deadline.
    Mapped memory must not be used after this."""

    code = grpc.StatusCode.UNAVAILABLE


class Draining(ServiceUnavailable):
    """The service is shutting down: it refuses new admissions but keeps serving the requests
    it has until they are released."""


class CapacityError(KVClientError):
    """The service has no request slot or host pages for the request right now. Retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnknownRequest(KVClientError):
    """The service does not know the request (or session) id."""

    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(KVClientError):
    """A field the service refused: bad lengths, bad layout, bad indices."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class LayoutMismatch(InvalidArgument):
    """The service's memory layout, device or GPU differs from what the engine was built for."""


class EpochMismatch(KVClientError):
    """The service restarted (new epoch): everything mapped from the old one is stale."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(KVClientError):
    """The service wants a token the client did not send, or a different one."""

    code = grpc.StatusCode.UNAUTHENTICATED


class AlreadyExists(KVClientError):
    """The request id is already live in this session."""

    code = grpc.StatusCode.ALREADY_EXISTS


class DeadlineExceeded(ServiceUnavailable):
    """A call to the service did not complete within its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


_BY_CODE: dict[grpc.StatusCode, type[KVClientError]] = {
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailable,
    grpc.StatusCode.CANCELLED: ServiceUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.NOT_FOUND: UnknownRequest,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: EpochMismatch,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}

_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int | grpc.StatusCode) -> grpc.StatusCode:
    """A grpc.StatusCode from its integer value (as carried by an in-band Error reply)."""
    if isinstance(value, grpc.StatusCode):
        return value
    return _BY_VALUE.get(int(value), grpc.StatusCode.UNKNOWN)


def from_status(code: int | grpc.StatusCode, message: str,
                details: Mapping[str, str] | None = None) -> KVClientError:
    """The typed error for a gRPC status code; unknown codes give the base class."""
    code = status_code(code)
    cls = _BY_CODE.get(code, KVClientError)
    err = cls(message or code.name, details)
    if cls is KVClientError:
        err.code = code
    return err


# The service sends the numbers of a unary RPC's error as trailing metadata with this prefix.
DETAIL_PREFIX = "kv-detail-"


def from_rpc_error(err: grpc.RpcError, what: str) -> KVClientError:
    """The typed error for a failed call; `what` names the call for the message."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    detail = err.details() if hasattr(err, "details") else str(err)
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    details = {key[len(DETAIL_PREFIX):].replace("-", "_"): str(value)
               for key, value in (trailers or ()) if key.startswith(DETAIL_PREFIX)}
    return from_status(code, f"{what}: {detail or code.name}", details)


@contextlib.contextmanager
def rpc_errors(what: str) -> Iterator[None]:
    """The one place where a failed gRPC call (sync or aio: AioRpcError is a grpc.RpcError)
    becomes a typed client error. Every client call runs inside it."""
    try:
        yield
    except grpc.RpcError as e:
        raise from_rpc_error(e, what) from e

"""The one place where a gRPC failure becomes a contract error: the client's half of the status
mapping whose server half is `transport.status`.

Every failure of the KV service reaches engine code as a `contract.errors` class: from a failed
call (`rpc_errors` / `from_rpc_error`, which decode the rich status: ErrorInfo reason and
metadata), from an in-band `Error` reply on the Session stream (`from_status`, same reason and
details), or from a lost connection. Embedded mode raises the same classes in-process. The
engine decides by type: a `CapacityError` keeps a request queued unless it is `permanent`,
`ServiceUnavailable` fails every running request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from contract.errors import (
    BY_REASON,
    DOMAIN,
    CapacityError,
    KVError,
    capacity_is_permanent,
    class_of_status,
    status_code_name_of,
)

_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int | grpc.StatusCode) -> grpc.StatusCode:
    """A grpc.StatusCode from its integer value (as carried by an in-band Error reply)."""
    if isinstance(value, grpc.StatusCode):
        return value
    return _BY_VALUE.get(int(value), grpc.StatusCode.UNKNOWN)


def code_of(err: BaseException) -> grpc.StatusCode:
    """The gRPC status code an error stands for (for messages and exit codes): the contract's
    table as the service sends it, a permanent capacity error's NEVER_FITS_CODE included."""
    code = getattr(err, "status", None)
    if isinstance(code, grpc.StatusCode):
        return code
    return grpc.StatusCode[status_code_name_of(err) or "UNKNOWN"]


def from_status(
    code: int | grpc.StatusCode,
    message: str,
    details: Mapping[str, str] | None = None,
    reason: str = "",
) -> KVError:
    """The typed error for a status: by ErrorInfo reason when known, else by status code
    (contract.errors.STATUS_CODES, read back; a capacity refusal's permanence too). The base
    class keeps the code in `status`."""
    code = status_code(code)
    details = dict(details or {})
    cls = BY_REASON.get(reason) or class_of_status(code.name)
    if issubclass(cls, CapacityError):
        permanent = capacity_is_permanent(code.name, details)
        details.pop("permanent", None)
        return cls(message or code.name, details, permanent=permanent)
    err = cls(message or code.name, details)
    if cls is KVError:
        err.status = code  # type: ignore[attr-defined]
    return err


def _error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The service's ErrorInfo from the call's rich status, if it sent one."""
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except (ValueError, AttributeError, TypeError):
        return None
    for packed in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if packed.Is(info.DESCRIPTOR) and packed.Unpack(info) and info.domain == DOMAIN:
            return info
    return None


def from_rpc_error(err: grpc.RpcError, what: str) -> KVError:
    """The typed error for a failed call; `what` names the call for the message."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    detail = err.details() if hasattr(err, "details") else str(err)
    info = _error_info(err)
    details = dict(info.metadata) if info is not None else {}
    return from_status(
        code, f"{what}: {detail or code.name}", details, info.reason if info is not None else ""
    )


@contextlib.contextmanager
def rpc_errors(what: str) -> Iterator[None]:
    """The one place where a failed gRPC call (sync or aio: AioRpcError is a grpc.RpcError)
    becomes a typed client error. Every client call runs inside it."""
    try:
        yield
    except grpc.RpcError as e:
        raise from_rpc_error(e, what) from e

"""The one mapping from a raised exception to what a client sees: a gRPC status code, a message,
and rich details (google.rpc.Status with ErrorInfo, plus QuotaFailure for capacity numbers).

Unary RPCs abort with the rich status (grpcio-status); the Session stream puts the same code,
reason and details into its in-band `Error` reply.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from contract import errors
from contract.layout import LayoutError

log = logging.getLogger(__name__)

# Capacity details come as <unit>_needed / <unit>_free / <unit>_total.
_QUOTA_SUFFIXES = ("_needed", "_free", "_total")
# The codes a client may retry unchanged (with backoff): the same call can succeed later. Every
# other code needs a change first (kvcache.proto documents both, per RPC).
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


@dataclass(frozen=True)
class Status:
    code: grpc.StatusCode
    message: str
    reason: str
    details: dict[str, str] = field(default_factory=dict)


def code_for(cls: type[BaseException]) -> grpc.StatusCode:
    """The status code of an error class (contract.errors.STATUS_CODES); INTERNAL outside it."""
    return grpc.StatusCode[errors.status_code_name(cls) or "INTERNAL"]


def status_of(exc: BaseException) -> Status:
    """What a client gets for `exc`. Unexpected exceptions become INTERNAL without leaking their
    text; they are logged here with the traceback."""
    if isinstance(exc, LayoutError):
        exc = errors.LayoutMismatch(str(exc))
    if isinstance(exc, errors.KVError):
        details = dict(exc.details)
        if isinstance(exc, errors.CapacityError):
            details["permanent"] = str(exc.permanent).lower()
        # The table's code; one that can never fit gets a code nobody retries (NEVER_FITS_CODE).
        code = grpc.StatusCode[errors.status_code_name_of(exc) or "INTERNAL"]
        return Status(code, exc.message, exc.reason, details)
    log.error("internal error", exc_info=exc)
    return Status(
        grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}", errors.KVError.reason
    )


def _packed(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _quota(details: dict[str, str]) -> error_details_pb2.QuotaFailure | None:
    units = sorted({k[: -len("_needed")] for k in details if k.endswith("_needed")})
    if not units:
        return None
    violations = [
        error_details_pb2.QuotaFailure.Violation(
            subject=unit,
            description=", ".join(
                f"{s[1:]} {details[unit + s]}" for s in _QUOTA_SUFFIXES if unit + s in details
            ),
        )
        for unit in units
    ]
    return error_details_pb2.QuotaFailure(violations=violations)


def rich_status(status: Status) -> grpc.Status:
    """The google.rpc.Status of `status`, ready for `context.abort_with_status`."""
    info = error_details_pb2.ErrorInfo(
        reason=status.reason, domain=errors.DOMAIN, metadata=status.details
    )
    extra = [_packed(info)]
    quota = _quota(status.details)  # capacity numbers, now or for good
    if quota is not None:
        extra.append(_packed(quota))
    proto = status_pb2.Status(code=status.code.value[0], message=status.message, details=extra)
    return rpc_status.to_status(proto)

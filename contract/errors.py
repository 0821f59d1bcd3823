"""The one hierarchy of KV errors, shared by the service, the embedded mode and the client.

Domain code raises these; they carry a machine-readable `reason` (google.rpc.ErrorInfo.reason)
and string `details`, never a transport status code. The server maps them to gRPC statuses in
one place (`transport.status`); the client decodes them in one place
(`engine_client.client.errors`),
so an engine sees the same class whether the service runs in-process or behind gRPC.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

# google.rpc.ErrorInfo.domain of every error the service sends.
DOMAIN = "hisparse.kv"


class KVError(Exception):
    """Base of every KV error. `details` are machine-readable strings, e.g. the numbers of a
    capacity shortage; they travel as ErrorInfo metadata."""

    reason: ClassVar[str] = "INTERNAL"

    def __init__(
        self, message: str, details: Mapping[str, object] | None = None, **more: object
    ) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, str] = {
            str(k): str(v) for k, v in {**(details or {}), **more}.items()
        }

    def __str__(self) -> str:
        if not self.details:
            return self.message
        extra = ", ".join(f"{k}={v}" for k, v in sorted(self.details.items()))
        return f"{self.message} ({extra})"

    def prefixed(self, what: str) -> KVError:
        """The same error (class, details, flags) with `what: ` before its message."""
        err = type(self).__new__(type(self))
        err.__dict__.update(self.__dict__)
        err.message = f"{what}: {self.message}"
        Exception.__init__(err, err.message)
        return err


class CapacityError(KVError):
    """Not enough pages, request slots or sessions. `permanent` is True when the request could
    not fit even on an empty service (retrying is useless); False when it may fit later."""

    reason = "CAPACITY_EXHAUSTED"

    def __init__(
        self,
        message: str,
        details: Mapping[str, object] | None = None,
        *,
        permanent: bool = False,
        **more: object,
    ) -> None:
        super().__init__(message, details, **more)
        self.permanent = bool(permanent)


class UnknownRequest(KVError):
    """The service does not know the request (or session) id."""

    reason = "UNKNOWN_REQUEST"


class UnknownSession(UnknownRequest):
    """No such session: never attached, detached, or its lease expired."""

    reason = "UNKNOWN_SESSION"


class AlreadyExists(KVError):
    """A request id that is already live in the session."""

    reason = "ALREADY_EXISTS"


class InvalidArgument(KVError):
    """A field the service refused: bad lengths, ids, layout or indices."""

    reason = "INVALID_ARGUMENT"


class LayoutMismatch(InvalidArgument):
    """The service's memory layout, device or GPU differs from what the engine was built for."""

    reason = "LAYOUT_MISMATCH"


class TransferUnsupported(InvalidArgument):
    """A transfer between processes was asked of a side without a NIXL agent: the service was
    started without --nixl, or the nixl package is not installed."""

    reason = "TRANSFER_UNSUPPORTED"


class SharedRowWrite(InvalidArgument):
    """A write into rows of a request's cached prefix: they live in shared pages, read-only
    and named by their content, that other requests read (and whose rows the shared hot region
    keeps once for all of them). A request's own writes start at its cached_tokens."""

    reason = "SHARED_ROW_WRITE"


class EpochMismatch(KVError):
    """The client's epoch is from another service run: everything it mapped is stale."""

    reason = "EPOCH_MISMATCH"


class Unauthenticated(KVError):
    """The service wants a token the client did not send, or a different one."""

    reason = "UNAUTHENTICATED"


class ServiceUnavailable(KVError):
    """The service is starting, gone, unreachable or did not answer. Mapped memory must not be
    used after this."""

    reason = "UNAVAILABLE"


class Draining(ServiceUnavailable):
    """The service is shutting down: no new admission; admitted requests are still served."""

    reason = "DRAINING"


class Stopping(Draining):
    """The service's drain is over and it stops (a restart or a shutdown): every session message
    is refused, and the requests it still holds go with it."""

    reason = "STOPPING"


class DeadlineExceeded(ServiceUnavailable):
    """A call did not complete within its deadline."""

    reason = "DEADLINE_EXCEEDED"


# The gRPC status code of each error class, by name (the contract imports no gRPC); a class not
# listed has its nearest listed ancestor's. The one table, read both ways: transport.status
# gives a raised error its code, engine_client.client.errors gives a code that came without an
# ErrorInfo (a proxy, grpc itself) its class.
STATUS_CODES: dict[type[KVError], str] = {
    KVError: "INTERNAL",
    CapacityError: "RESOURCE_EXHAUSTED",
    UnknownRequest: "NOT_FOUND",
    AlreadyExists: "ALREADY_EXISTS",
    InvalidArgument: "INVALID_ARGUMENT",
    EpochMismatch: "FAILED_PRECONDITION",
    Unauthenticated: "UNAUTHENTICATED",
    ServiceUnavailable: "UNAVAILABLE",
    DeadlineExceeded: "DEADLINE_EXCEEDED",
}
# Read back only: a call cancelled under the client (its channel closed) lost the service too.
_CLASS_OF_CODE: dict[str, type[KVError]] = {
    **{code: cls for cls, code in STATUS_CODES.items()},
    "CANCELLED": ServiceUnavailable,
}


# The one exception to the table, by instance: a CapacityError that can never fit (`permanent`:
# not even on an empty service) is sent with this code, not RESOURCE_EXHAUSTED, because clients
# and proxies retry RESOURCE_EXHAUSTED with backoff. Its reason stays CAPACITY_EXHAUSTED, its
# numbers are in the details; read back, a capacity refusal with this code is permanent.
NEVER_FITS_CODE = "INVALID_ARGUMENT"


def status_code_name(cls: type[BaseException]) -> str | None:
    """The status code name of an error class; None for an exception outside the taxonomy."""
    for base in cls.__mro__:
        if base in STATUS_CODES:
            return STATUS_CODES[base]
    return None


def status_code_name_of(err: BaseException) -> str | None:
    """The status code name `err` is sent with: its class's, but NEVER_FITS_CODE for a permanent
    CapacityError; None for an exception outside the taxonomy."""
    if isinstance(err, CapacityError) and err.permanent:
        return NEVER_FITS_CODE
    return status_code_name(type(err))


def capacity_is_permanent(code_name: str, details: Mapping[str, str]) -> bool:
    """Read back: whether a capacity refusal that came with this code and these details can
    never fit (NEVER_FITS_CODE, or the details' `permanent` flag)."""
    return code_name == NEVER_FITS_CODE or details.get("permanent") == "true"


def class_of_status(code_name: str) -> type[KVError]:
    """The error class a status code stands for (the base class for a code of no class)."""
    return _CLASS_OF_CODE.get(code_name, KVError)


def _all_classes(root: type[KVError]) -> list[type[KVError]]:
    out = [root]
    for sub in root.__subclasses__():
        out += _all_classes(sub)
    return out


BY_REASON: dict[str, type[KVError]] = {cls.reason: cls for cls in _all_classes(KVError)}

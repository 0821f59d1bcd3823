"""The one hierarchy of KV errors, shared by the service, the embedded mode and the client.

Domain code raises these; they carry a machine-readable `reason` (google.rpc.ErrorInfo.reason)
and string `details`, never a transport status code. The server maps them to gRPC statuses in
one place (`kv_service.status`); the client decodes them in one place
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


class DeadlineExceeded(ServiceUnavailable):
    """A call did not complete within its deadline."""

    reason = "DEADLINE_EXCEEDED"


# Names used on the service side before the contract existed.
WrongEpoch = EpochMismatch
Unavailable = ServiceUnavailable


def _all_classes(root: type[KVError]) -> list[type[KVError]]:
    out = [root]
    for sub in root.__subclasses__():
        out += _all_classes(sub)
    return out


BY_REASON: dict[str, type[KVError]] = {cls.reason: cls for cls in _all_classes(KVError)}

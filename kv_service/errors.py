"""The service's names for the contract's errors (`contract.errors`), kept so domain code and
older imports read as before. No gRPC here: `transport.status` maps errors to statuses."""

from __future__ import annotations

from contract.errors import (
    AlreadyExists,
    CapacityError,
    DeadlineExceeded,
    Draining,
    EpochMismatch,
    InvalidArgument,
    KVError,
    LayoutMismatch,
    ServiceUnavailable,
    Stopping,
    Unauthenticated,
    UnknownRequest,
    UnknownSession,
)

__all__ = [
    "AlreadyExists",
    "CapacityError",
    "DeadlineExceeded",
    "Draining",
    "EpochMismatch",
    "InvalidArgument",
    "KVError",
    "LayoutMismatch",
    "ServiceUnavailable",
    "Stopping",
    "Unauthenticated",
    "UnknownRequest",
    "UnknownSession",
]

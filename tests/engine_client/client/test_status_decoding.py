"""The client's one place where a gRPC failure becomes a contract error (`client/status.py`):
what the service sends as rich status comes back as the same class with the same details, a
code without ErrorInfo (a proxy, grpc itself) falls back to the contract's table, and a
permanent capacity refusal stays permanent."""

from __future__ import annotations

import grpc
import pytest

from contract import errors
from engine_client.client.status import (
    code_of,
    from_rpc_error,
    from_status,
    rpc_errors,
    status_code,
)
from transport.status import rich_status, status_of


class FailedCall(grpc.RpcError):
    """A failed call as grpc raises it: code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing=()) -> None:
        self._code, self._details, self._trailing = code, details, tuple(trailing)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return self._trailing


def _as_sent(err: errors.KVError) -> FailedCall:
    """What a client receives when the service aborts with `err` (transport/status.py)."""
    status = rich_status(status_of(err))
    return FailedCall(status.code, status.details, status.trailing_metadata)


@pytest.mark.parametrize(
    "err",
    [
        errors.UnknownSession("session s gone", session_id="s"),
        errors.LayoutMismatch("page size 8 is not 16"),
        errors.Draining("draining"),
        errors.CapacityError("full", pages_needed=3, pages_free=1),
    ],
    ids=lambda e: type(e).__name__,
)
def test_what_the_service_sends_comes_back_as_the_same_class(err) -> None:
    got = from_rpc_error(_as_sent(err), "Admit")
    assert type(got) is type(err) and got.message == f"Admit: {err.message}"
    assert {k: v for k, v in got.details.items() if k != "permanent"} == err.details


def test_a_permanent_capacity_refusal_stays_permanent() -> None:
    err = errors.CapacityError("never fits", permanent=True, tokens_needed=9)
    got = from_rpc_error(_as_sent(err), "Admit")
    assert isinstance(got, errors.CapacityError) and got.permanent
    assert code_of(got) is grpc.StatusCode.INVALID_ARGUMENT


def test_a_code_without_error_info_falls_back_to_the_table() -> None:
    got = from_rpc_error(FailedCall(grpc.StatusCode.UNAVAILABLE, "connect failed"), "Attach")
    assert type(got) is errors.ServiceUnavailable
    assert str(got) == "Attach: connect failed"
    cancelled = from_rpc_error(FailedCall(grpc.StatusCode.CANCELLED, ""), "Session")
    assert type(cancelled) is errors.ServiceUnavailable  # the channel went away


def test_rpc_errors_turns_a_failed_call_into_a_typed_error_with_its_cause() -> None:
    call = FailedCall(grpc.StatusCode.NOT_FOUND, "no such request")
    with pytest.raises(errors.UnknownRequest) as caught:
        with rpc_errors("Release"):
            raise call
    assert caught.value.__cause__ is call


def test_status_code_reads_an_in_band_integer() -> None:
    assert status_code(8) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_code(999) is grpc.StatusCode.UNKNOWN
    assert status_code(grpc.StatusCode.OK) is grpc.StatusCode.OK


def test_error_mapping() -> None:
    cases = {
        5: errors.UnknownRequest,
        8: errors.CapacityError,
        3: errors.InvalidArgument,
        9: errors.EpochMismatch,
        16: errors.Unauthenticated,
        14: errors.ServiceUnavailable,
        4: errors.DeadlineExceeded,
        6: errors.AlreadyExists,
    }
    for code, cls in cases.items():
        err = from_status(code, "m", {"a": "1"})
        assert type(err) is cls and err.details == {"a": "1"}
    other = from_status(grpc.StatusCode.INTERNAL, "boom")
    assert type(other) is errors.KVError and other.status is grpc.StatusCode.INTERNAL
    assert isinstance(errors.DeadlineExceeded("x"), errors.ServiceUnavailable)

"""The one error -> google.rpc.Status mapping (`transport/status.py`): the code, message and
details a raised exception becomes, and the rich status a unary RPC aborts with (ErrorInfo in
our domain, and QuotaFailure for capacity numbers). The proto's per-RPC table is checked
against it in tests/contract/test_status_table.py."""

from __future__ import annotations

import logging

import grpc
from google.rpc import error_details_pb2, status_pb2

from contract import errors
from contract.layout import LayoutError
from transport.status import Status, code_for, rich_status, status_of


def _details(status: grpc.Status) -> tuple[status_pb2.Status, list]:
    """The google.rpc.Status a client decodes from the abort's trailing metadata."""
    ((key, value),) = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    proto = status_pb2.Status.FromString(value)
    unpacked = []
    for packed in proto.details:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.QuotaFailure):
            if packed.Is(cls.DESCRIPTOR):
                msg = cls()
                packed.Unpack(msg)
                unpacked.append(msg)
    return proto, unpacked


def test_a_domain_error_keeps_its_message_reason_and_details() -> None:
    s = status_of(errors.UnknownRequest("request r1 unknown", request_id="r1"))
    assert s == Status(
        grpc.StatusCode.NOT_FOUND, "request r1 unknown", "UNKNOWN_REQUEST", {"request_id": "r1"}
    )


def test_capacity_is_retryable_now_and_invalid_for_good() -> None:
    later = status_of(errors.CapacityError("full", pages_needed=4, pages_free=1))
    never = status_of(errors.CapacityError("too long", permanent=True, tokens_needed=9))
    assert (
        later.code is grpc.StatusCode.RESOURCE_EXHAUSTED and later.details["permanent"] == "false"
    )
    assert never.code is grpc.StatusCode.INVALID_ARGUMENT and never.details["permanent"] == "true"
    assert later.reason == never.reason == "CAPACITY_EXHAUSTED"


def test_a_bad_layout_is_a_layout_mismatch() -> None:
    s = status_of(LayoutError("page_size must be > 0"))
    assert (s.code, s.reason) == (grpc.StatusCode.INVALID_ARGUMENT, errors.LayoutMismatch.reason)


def test_an_unexpected_exception_is_internal_and_its_text_stays_in_the_log(caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="transport.status"):
        s = status_of(RuntimeError("secret path /home/x"))
    assert s.code is grpc.StatusCode.INTERNAL and "secret" not in s.message
    assert "RuntimeError" in s.message and "secret path" in caplog.text
    assert code_for(RuntimeError) is grpc.StatusCode.INTERNAL
    assert code_for(errors.Draining) is grpc.StatusCode.UNAVAILABLE  # the nearest listed base


def test_rich_status_carries_error_info_and_one_quota_violation_per_unit() -> None:
    err = errors.CapacityError("full", pages_needed=4, pages_free=1, pages_total=8, slots_needed=1)
    status = rich_status(status_of(err))
    assert status.code is grpc.StatusCode.RESOURCE_EXHAUSTED and status.details == "full"
    proto, (info, quota) = _details(status)
    assert proto.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and proto.message == "full"
    assert (info.reason, info.domain) == ("CAPACITY_EXHAUSTED", errors.DOMAIN)
    assert dict(info.metadata)["pages_free"] == "1"
    violations = {v.subject: v.description for v in quota.violations}
    assert violations == {"pages": "needed 4, free 1, total 8", "slots": "needed 1"}


def test_rich_status_without_capacity_numbers_has_no_quota_failure() -> None:
    _, details = _details(rich_status(status_of(errors.EpochMismatch("old epoch"))))
    assert [type(d) for d in details] == [error_details_pb2.ErrorInfo]

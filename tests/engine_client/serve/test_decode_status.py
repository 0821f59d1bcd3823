"""decode.v1 errors carry the google.rpc.Status details kvcache.v1's do (one mapping,
transport.status): code, message, ErrorInfo reason; INTERNAL for an untyped error."""

from __future__ import annotations

import asyncio

import grpc
from google.rpc import error_details_pb2, status_pb2

from contract import errors
from engine_client.serve.interceptor import abort_rich


class _Context:
    def __init__(self) -> None:
        self.status: grpc.Status | None = None

    async def abort_with_status(self, status: grpc.Status) -> None:
        self.status = status


def _sent(exc: Exception) -> tuple[grpc.StatusCode, str, status_pb2.Status]:
    ctx = _Context()
    asyncio.run(abort_rich(exc, ctx))  # type: ignore[arg-type]
    assert ctx.status is not None
    raw = dict(ctx.status.trailing_metadata)["grpc-status-details-bin"]
    return ctx.status.code, ctx.status.details, status_pb2.Status.FromString(raw)


def test_typed_error_carries_error_info() -> None:
    code, message, rich = _sent(errors.InvalidArgument("bad prompt"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message == "bad prompt"
    info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(info) for d in rich.details)
    assert info.reason == errors.InvalidArgument.reason


def test_untyped_error_is_internal_without_its_text() -> None:
    code, message, _ = _sent(RuntimeError("secret"))
    assert code == grpc.StatusCode.INTERNAL and "secret" not in message

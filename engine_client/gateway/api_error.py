"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the HTTP status
that goes with them. The engine's gRPC status (decoded by engine_client.client.status, the one
place that decodes it) picks the HTTP status here, in one table."""

from __future__ import annotations

import grpc

from contract import errors
from engine_client.client.status import code_of

# gRPC status of a failed Generate -> (HTTP status, OpenAI error type, code).
BY_GRPC: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    # The engine's queue is full or a request waited longer than its --max-queue-wait.
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "queue_full"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "engine_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
INTERNAL = (500, "server_error", None)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> ApiError:
        return cls(400, message, "invalid_request_error", param)

    @classmethod
    def from_engine(cls, err: errors.KVError) -> ApiError:
        status, type_, code = BY_GRPC.get(code_of(err), INTERNAL)
        return cls(status, err.message, type_, None, code)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

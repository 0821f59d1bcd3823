"""The gateway's orphan canceller (engine_client/gateway/orphans.py) outlives a failed attempt:
its task has no one awaiting it, so an unexpected error in one attempt must not end it with the
request still pending (it logs and tries again until the request's deadline)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from engine_client.gateway import orphans
from engine_client.gateway.orphans import Orphans


def test_an_unexpected_error_in_one_attempt_does_not_end_the_canceller(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(orphans, "RETRY", 0.01)
    attempts: list[str] = []

    async def serving(self, timeout: float) -> bool:
        return True

    async def attach(self, request_id: str) -> bool:
        attempts.append(request_id)
        if len(attempts) == 1:
            raise RuntimeError("an error no attempt expects")
        return True

    monkeypatch.setattr(Orphans, "_until_serving", serving)
    monkeypatch.setattr(Orphans, "_attach_and_cancel", attach)

    async def main() -> None:
        channel = grpc.aio.insecure_channel("unix:/nonexistent/engine.sock")
        o = Orphans(channel, "decode.v1.DecodeService", window=5.0)
        o.cancel("r1")
        async with asyncio.timeout(5):
            while o.pending:
                await asyncio.sleep(0.01)
        await o.close()
        await channel.close()

    with caplog.at_level(logging.ERROR, logger=orphans.__name__):
        asyncio.run(main())
    assert attempts == ["r1", "r1"]
    assert "trying again" in caplog.text

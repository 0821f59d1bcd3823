"""A compute step that raises ends its requests with INTERNAL, and the log names the step, what
it ran and how many KV service recoveries came before it (what one GPU run needs to tell where
a failure after a re-attach happened). The engine goes on serving."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine_client.loop.request import FailStatus, Finish, SamplingParams
from engine_client.serve.factory import build_engine
from tests.process_harness import engine_config

pytestmark = [pytest.mark.timeout(120)]


async def _done(req) -> None:
    async for _ in req.follow():
        pass


def test_a_failed_step_is_logged_with_its_step_and_ends_its_requests(caplog) -> None:
    async def run():
        engine = await build_engine(engine_config("baseline"))
        launch, calls = engine.step_runner.launch, []

        def failing(batch):
            calls.append(batch.step)
            if len(calls) == 1:
                raise RuntimeError("capture failed on purpose")
            return launch(batch)

        engine.step_runner.launch = failing
        engine.start()
        try:
            first = engine.api.submit((1, 2, 3), 4, SamplingParams())
            await asyncio.wait_for(_done(first), 60)
            second = engine.api.submit((1, 2, 3), 4, SamplingParams())
            await asyncio.wait_for(_done(second), 60)
            return first, second
        finally:
            await engine.stop()

    with caplog.at_level(logging.ERROR, logger="engine_client.loop.engine"):
        first, second = asyncio.run(run())
    assert first.finish is Finish.ERROR and first.status is FailStatus.INTERNAL
    assert "capture failed on purpose" in first.error
    assert second.finish is Finish.LENGTH
    (line,) = [r.getMessage() for r in caplog.records if "compute step" in r.getMessage()]
    assert line.startswith("compute step 0 failed (0 decode rows, prefill ")
    assert "0 KV service recoveries before it): RuntimeError: capture failed on purpose" in line

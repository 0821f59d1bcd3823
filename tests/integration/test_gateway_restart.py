"""A gateway stream cut by an engine restart (real processes, CPU): the engine stops (SIGTERM or
killed, `--state-file`) under a streamed request; the gateway answers its client with an error
event; the restarted engine resumes the request from its state file, and the gateway cancels
it there: no engine decodes for a client that is gone."""

from __future__ import annotations

import asyncio
import os
import re
import time

import aiohttp
import pytest

from engine_client.gateway.config import GatewayConfig
from engine_client.gateway.server import start
from engine_client.serve.procs import ManagedProcess
from tests.process_harness import start_engine, start_service, workdir
from tests.service_harness import ServiceProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
QUEUED = re.compile(r"request (\w+) queued")


def _stop(eng: ManagedProcess, how: str) -> None:
    if how == "kill":
        eng.proc.kill()
        eng.proc.wait(10)
    else:
        assert eng.stop() == 0, eng.log()


async def _cut_and_restart(
    engines: list[ManagedProcess], svc: ServiceProcess, extra: tuple, how: str
) -> str:
    """Stream through an in-process gateway, stop the engine (engines[0]) under the stream
    (SIGTERM or SIGKILL), start it again (same socket, same state file; appended to engines);
    the new engine's log once the request is cancelled in it (or after 20 s)."""
    eng = engines[0]
    runner, url = await start(GatewayConfig(target=eng.target, http="127.0.0.1:0"))
    try:
        async with aiohttp.ClientSession() as s:
            body = {"prompt": [3, 4, 5], "max_tokens": 120, "stream": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert (await r.content.readline()).startswith(b"data: {")
                await asyncio.to_thread(_stop, eng, how)
                rest = await r.text()
        assert '"error"' in rest and "resume" not in rest, rest
        assert "retry the request" in rest or how == "kill", rest
        rid = QUEUED.search(eng.log(None))[1]
        start_at = len(eng.log(None))  # the restarted engine appends to the same log
        path = os.path.dirname(eng.log_path)
        engines.append(await asyncio.to_thread(start_engine, path, "service", svc, "engine", extra))
        # Until the cancel's last line: "went away: cancelling it" is logged a step earlier,
        # and a wait for that line alone returned before this one was written whenever the
        # restarted engine was seen serving at once.
        cancelled = re.compile(rf"request {rid} cancelled after \d+ tokens")
        deadline = time.monotonic() + 20
        while not cancelled.search(eng.log(None)[start_at:]) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return eng.log(None)[start_at:]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("how", ["sigterm", "kill"])
def test_a_stream_cut_by_an_engine_restart_is_cancelled_in_the_new_engine(how: str) -> None:
    with workdir("gwr") as path:
        svc = start_service(path)
        extra = ("--state-file", os.path.join(path, "engine.state"))
        engines = [start_engine(path, "service", svc, extra=extra)]
        try:
            log = asyncio.run(_cut_and_restart(engines, svc, extra, how))
            rid = QUEUED.search(engines[0].log(None))[1]
            assert f"client of request {rid} went away: cancelling it" in log, log
            # It did not run to its 120th token for no client.
            assert re.search(rf"request {rid} cancelled after \d+ tokens", log), log
        finally:
            for eng in engines:
                eng.stop()
            assert svc.stop() == 0, svc.log()

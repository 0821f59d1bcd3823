"""A request that failed because the KV service died can be resumed once the engine has
re-attached to a restarted service (CPU, real processes): the engine prefills the prompt plus
the tokens already streamed again and continues with the tokens of an uninterrupted greedy run.
Before the re-attach, a resume is refused with UNAVAILABLE, as new requests are."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2

from contract import errors
from engine_client.cli.config import GenerateConfig
from engine_client.cli.generate import GenerationResult, generate_stream
from engine_client.client.status import code_of
from tests.process_harness import STARTUP, engine_channel, start_engine, start_service, workdir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# 20 + 40 tokens: offloaded (more than the 32 hot slots), so the replay reads the host tier too.
GREEDY = GenerateConfig(target="", prompt=tuple(range(3, 23)), max_new_tokens=40, timeout=60)
KILL_AT = 9


async def _stream(eng, cfg: GenerateConfig, result: GenerationResult, kill=None) -> None:
    async with engine_channel(eng) as channel:
        async for index, _ in generate_stream(channel, cfg, result):
            if index == KILL_AT and kill is not None:
                kill()


def test_a_request_lost_with_its_service_resumes_after_the_reattach() -> None:
    with workdir("hsv") as path:
        svc = start_service(path)
        eng = start_engine(path, "service", svc)
        svc2 = None
        try:
            reference = GenerationResult()
            asyncio.run(_stream(eng, GREEDY, reference))
            assert reference.finish_reason == "LENGTH", reference.error

            lost = GenerationResult()
            with pytest.raises(errors.ServiceUnavailable):
                asyncio.run(_stream(eng, GREEDY, lost, kill=svc.kill))
            assert lost.request_id and len(lost.tokens) >= KILL_AT + 1
            assert lost.tokens == reference.tokens[: len(lost.tokens)]
            eng.wait_status(health_pb2.HealthCheckResponse.NOT_SERVING, timeout=30)

            resume = dataclasses.replace(GREEDY, resume_request_id=lost.request_id)
            with pytest.raises(errors.ServiceUnavailable) as early:
                asyncio.run(_stream(eng, resume, GenerationResult()))
            assert code_of(early.value) is grpc.StatusCode.UNAVAILABLE

            svc2 = start_service(path)
            eng.wait_serving(STARTUP["cpu"])
            resumed = GenerationResult()
            asyncio.run(_stream(eng, resume, resumed))
            assert resumed.finish_reason == "LENGTH", f"{resumed.error}\n{eng.log()}"
            assert resumed.tokens == reference.tokens  # replayed from 0, then continued
            assert f"request {lost.request_id} revived after" in eng.log(None)
        finally:
            assert eng.stop() == 0, eng.log()
            if svc2 is not None:
                assert svc2.stop() == 0, svc2.log()
            svc.kill()


def test_a_revived_request_restarted_mid_replay_prefills_again(tmp_path) -> None:
    """The state file of a revived request: its start record names the replayed tokens and
    carries them; an engine restarted before a new token came redoes the whole re-prefill,
    one restarted after it decodes on."""
    from engine_client.client.control import HeldRequest
    from engine_client.loop import state_file
    from engine_client.loop.request import Finish, GenRequest, Phase, SamplingParams
    from engine_client.serve.restore import resumed
    from engine_client.text import vocabulary

    tiny = vocabulary.load(vocabulary.TINY)
    req = GenRequest("r", (5, 6, 7), 8, SamplingParams())
    for t in (11, 12, 13):
        req.add_token(t, 0.0)
    req.lost_kv = True
    req.end(Finish.ERROR, "KV service lost")
    req.revive()
    assert (req.phase, req.replayed, req.context) == (Phase.WAITING, 3, (5, 6, 7, 11, 12, 13))
    path = str(tmp_path / "engine.state")
    f = state_file.StateFile(path)
    f.rewrite("s2", 1, [])
    f.started(req)
    f.tokens({})
    saved = state_file.load(path).requests["r"]
    assert (saved.tokens, saved.replayed) == ([11, 12, 13], 3)
    held = HeldRequest("r", 0, 2, 4, 3, 8)
    again = resumed(held, saved, tiny)
    assert (again.phase, again.replayed, again.context_len) == (Phase.PREFILL, 3, 6)
    f.tokens({"r": [14]})
    f.close()
    on = resumed(held, state_file.load(path).requests["r"], tiny)
    assert (on.phase, on.replayed, on.tokens) == (Phase.RUNNING, 0, [11, 12, 13, 14])
    with pytest.raises(ValueError):
        on.revive()  # not failed by a KV loss

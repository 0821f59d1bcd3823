"""Engine and KV service as separate processes over UDS: faults and restarts (CPU).

- the service is killed mid-stream: the client's stream ends with UNAVAILABLE within seconds;
- the service is stopped mid-stream (SIGTERM, a drain shorter than the request): the client is
  told so, and to resume its request by id, not given an internal gRPC error;
- the engine is SIGKILLed mid-stream: a new engine on the same state file re-attaches to the
  session, and the resumed stream gives exactly the tokens of an uninterrupted run;
- a client that cancels its stream frees the request's KV at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from contract import errors
from engine_client.cli.config import GenerateConfig
from engine_client.cli.generate import GenerationResult, generate_stream
from engine_client.client.status import code_of
from proto.kvcache.v1 import kvcache_pb2 as kpb
from proto.kvcache.v1 import kvcache_pb2_grpc as kpb_grpc
from tests.process_harness import (
    STARTUP,
    engine_channel,
    holds_only_cache,
    layout_with,
    service_stats,
    start_engine,
    start_service,
    workdir,
)
from tests.service_harness import ServiceProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROMPT = tuple((5 * i) % 200 + 3 for i in range(30))
SAMPLED = GenerateConfig(
    target="", prompt=PROMPT, max_new_tokens=40, temperature=0.9, seed=11, timeout=60
)


async def _stream(
    eng, cfg: GenerateConfig, stop_after: int | None = None, skip_below: int = 0
) -> GenerationResult:
    """Stream a generation; with stop_after, return once that many tokens arrived (the stream
    stays open until the caller's loop ends)."""
    result = GenerationResult()
    async with engine_channel(eng) as channel:
        async for index, _ in generate_stream(channel, cfg, result, skip_below):
            if stop_after is not None and len(result.tokens) >= stop_after:
                break
    return result


def test_service_killed_mid_stream_fails_fast_with_unavailable() -> None:
    with workdir() as path:
        svc = start_service(path)
        eng = start_engine(path, "service", svc)
        try:

            async def run() -> float:
                result = GenerationResult()
                async with engine_channel(eng) as channel:
                    with pytest.raises(errors.ServiceUnavailable) as err:
                        async for index, _ in generate_stream(channel, SAMPLED, result):
                            if index == 2:
                                svc.kill()
                                killed = time.monotonic()
                    assert code_of(err.value) is grpc.StatusCode.UNAVAILABLE
                    return time.monotonic() - killed

            assert asyncio.run(run()) < 5.0
        finally:
            assert eng.stop() == 0, eng.log()
            svc.kill()


def test_service_stopped_mid_stream_tells_the_client_to_resume() -> None:
    """A `restart kv-service` with a short drain: once the drain is over the service answers
    the engine's session messages with UNAVAILABLE (reason STOPPING) until it stops, and the
    engine fails the stream saying what happened and what to do."""
    long_job = GenerateConfig(target="", prompt=PROMPT, max_new_tokens=900, timeout=60)
    with workdir() as path:
        layout = layout_with(max_context=1024, num_pages=256)  # room for a long request
        svc = ServiceProcess(path, "stopped", "--drain-timeout", "0.1", layout=layout)
        svc.start().wait_serving(STARTUP["cpu"])
        eng = start_engine(path, "service", svc)
        try:
            result = GenerationResult()

            async def run() -> None:
                async with engine_channel(eng) as channel:
                    async for index, _ in generate_stream(channel, long_job, result):
                        if index == 2:
                            svc.signal(signal.SIGTERM)

            with pytest.raises(errors.ServiceUnavailable) as err:
                asyncio.run(run())
            said = str(err.value)
            assert "stopping" in said and "Internal" not in said, said
            assert f"generate --resume {result.request_id}" in said, said
            assert len(result.tokens) < long_job.max_new_tokens
        finally:
            assert eng.stop() == 0, eng.log()
            svc.kill()


def test_idle_engine_turns_not_serving_when_the_service_dies() -> None:
    with workdir() as path:
        svc = start_service(path)
        eng = start_engine(path, "service", svc)
        try:
            svc.kill()
            killed = time.monotonic()
            eng.wait_status(health_pb2.HealthCheckResponse.NOT_SERVING, timeout=10)
            assert time.monotonic() - killed < 5.0
        finally:
            eng.kill()


def test_engine_killed_then_resumed_gives_identical_tokens() -> None:
    with workdir() as path:
        svc = start_service(path)
        state = os.path.join(path, "engine.state")
        eng = start_engine(path, "service", svc, extra=("--state-file", state))
        try:
            reference = asyncio.run(_stream(eng, SAMPLED))
            assert len(reference.tokens) == SAMPLED.max_new_tokens

            async def interrupted() -> GenerationResult:
                result = GenerationResult()
                async with engine_channel(eng) as channel:
                    async for index, _ in generate_stream(channel, SAMPLED, result):
                        if index == 9:
                            eng.signal(9)  # SIGKILL: no cleanup, no detach
                            break
                return result

            first = asyncio.run(interrupted())
            eng.proc.wait(10)
            eng2 = start_engine(path, "service", svc, name="engine2", extra=("--state-file", state))
            try:
                resume = GenerateConfig(
                    target="",
                    prompt=(),
                    max_new_tokens=1,
                    resume_request_id=first.request_id,
                    timeout=60,
                )
                rest = asyncio.run(_stream(eng2, resume, skip_below=len(first.tokens)))
                assert rest.finish_reason == "LENGTH", rest.error
                assert (
                    len(first.tokens) == 10 and f"resumed request {first.request_id}" in eng2.log()
                )
                assert first.tokens + rest.tokens == reference.tokens
                # The last token reaches the client before the engine's release reaches the
                # service (releases wait for the device): Drain waits, with a deadline, until no
                # request is admitted (CI once read the stats in between).
                drained = kpb_grpc.KVCacheServiceStub(svc.channel).Drain(
                    kpb.DrainRequest(timeout_seconds=10), timeout=15
                )
                stats = service_stats(svc)
                assert drained.drained and holds_only_cache(stats), stats
            finally:
                assert eng2.stop() == 0, eng2.log()
        finally:
            eng.kill()
            assert svc.stop() == 0, svc.log()
        assert svc.segment_files() == []


def test_requests_queued_at_an_engine_kill_are_resumed_after_the_restart() -> None:
    """An id handed out is resumable: with one request slot (--max-batch 1) a second request
    waits behind a long first one; the engine is SIGKILLed while it waits (its id already on
    the client's side), and the restarted engine runs it: its resumed stream is the whole of an
    uninterrupted run, and the first request resumes too."""
    greedy = dataclasses.replace(SAMPLED, temperature=0.0, max_new_tokens=12)
    long_job = dataclasses.replace(greedy, max_new_tokens=60)
    with workdir() as path:
        svc = start_service(path)
        state = os.path.join(path, "engine.state")
        extra = ("--state-file", state, "--max-batch", "1")
        eng = start_engine(path, "service", svc, extra=extra)
        try:
            reference = asyncio.run(_stream(eng, greedy))

            async def killed_while_queued() -> tuple[GenerationResult, GenerationResult]:
                first, queued = GenerationResult(), GenerationResult()
                decoding = asyncio.Event()

                async def follow(cfg, result, on_id=None) -> None:
                    async with engine_channel(eng) as channel:
                        with contextlib.suppress(errors.ServiceUnavailable):
                            async for _ in generate_stream(channel, cfg, result, 0, on_id):
                                decoding.set()

                async def second() -> None:
                    await decoding.wait()  # the first request holds the one slot
                    # SIGKILL as soon as the id is handed out: the request is still queued.
                    await follow(greedy, queued, lambda _: eng.signal(9))

                await asyncio.gather(follow(long_job, first), second())
                return first, queued

            first, queued = asyncio.run(killed_while_queued())
            assert queued.request_id and queued.tokens == [], queued
            eng.proc.wait(10)
            eng = start_engine(path, "service", svc, name="engine2", extra=extra)
            whole = []
            for done in (queued, first):
                resume = GenerateConfig(
                    target="", prompt=(), max_new_tokens=1, resume_request_id=done.request_id
                )
                rest = asyncio.run(_stream(eng, resume, skip_below=len(done.tokens)))
                assert rest.finish_reason == "LENGTH", rest.error
                whole.append(done.tokens + rest.tokens)
            assert whole[0] == reference.tokens
            assert len(whole[1]) == long_job.max_new_tokens
            assert f"queued request {queued.request_id} again" in eng.log()
        finally:
            assert eng.stop() == 0, eng.log()
            assert svc.stop() == 0, svc.log()


def test_client_cancel_frees_the_request() -> None:
    with workdir() as path:
        svc = start_service(path)
        eng = start_engine(path, "service", svc)
        try:
            partial = asyncio.run(_stream(eng, SAMPLED, stop_after=3))
            assert len(partial.tokens) == 3
            # Drain waits (event-driven, with a deadline) until no request is admitted.
            drained = kpb_grpc.KVCacheServiceStub(svc.channel).Drain(
                kpb.DrainRequest(timeout_seconds=10), timeout=15
            )
            assert drained.drained
            stats = service_stats(svc)
            assert holds_only_cache(stats), stats
        finally:
            assert eng.stop() == 0, eng.log()
            assert svc.stop() == 0, svc.log()


def test_queue_wait_limit_gives_resource_exhausted_with_a_message() -> None:
    """One request slot (--max-batch 1): a second request waits behind a long first one and
    fails with RESOURCE_EXHAUSTED once it waited --max-queue-wait; the first goes on."""
    long_job = GenerateConfig(target="", prompt=PROMPT[:8], max_new_tokens=110, timeout=60)
    short_job = GenerateConfig(target="", prompt=PROMPT[:8], max_new_tokens=4, timeout=60)
    with workdir() as path:
        eng = start_engine(path, "baseline", extra=("--max-batch", "1", "--max-queue-wait", "0.05"))
        try:

            async def run():
                started = asyncio.Event()

                async def long_stream():
                    async with engine_channel(eng) as channel:
                        async for _ in generate_stream(channel, long_job, GenerationResult()):
                            started.set()  # decoding: the next request must queue

                task = asyncio.create_task(long_stream())
                await started.wait()
                with pytest.raises(errors.KVError) as err:
                    await _stream(eng, short_job)
                done = task.done()
                task.cancel()
                return err.value, done

            err, long_done = asyncio.run(run())
            assert not long_done
            assert code_of(err) is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max queue wait 0.05 s" in str(err)
        finally:
            assert eng.stop() == 0, eng.log()

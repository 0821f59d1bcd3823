"""serve/restore.py: a request rebuilt from the state file after an engine restart is the request
that was saved, its cache salt included (the salt names its pages' namespace at release: a
resumed request without it would offer its pages to every tenant); and what an engine killed at
a bad moment leaves in its state file is what a restarted engine resumes, no more, no less."""

from __future__ import annotations

import asyncio

import pytest

from contract import errors
from engine_client.client.control import HeldRequest
from engine_client.loop import state_file
from engine_client.loop.request import Finish, GenRequest, SamplingParams
from engine_client.serve.factory import build_engine
from engine_client.serve.restore import resumed
from tests.process_harness import engine_config, start_service, wait_until, workdir


def test_a_resumed_request_keeps_its_cache_salt(tmp_path) -> None:
    req = GenRequest("r1", (5, 6, 7), 8, SamplingParams(), cache_salt="tenant-a")
    req.tokens = [9, 10]
    path = str(tmp_path / "state.jsonl")
    state_file.StateFile(path).rewrite("s1", 1, [req])
    saved = state_file.load(path).requests["r1"]
    held = HeldRequest("r1", slot=2, mode=1, seq_len=4, prompt_len=3, max_new_tokens=8)
    again = resumed(held, saved, None)
    assert again is not None
    assert (again.cache_salt, again.slot, again.tokens) == ("tenant-a", 2, [9, 10])


# --- what an engine killed now leaves in its state file (a real service, the engine in-process)

PROMPT, NEW = tuple(range(3, 15)), 24


@pytest.fixture(scope="module")
def service():
    with workdir("hsr") as path:
        svc = start_service(path)
        try:
            yield svc
        finally:
            assert svc.stop() == 0, svc.log()


async def _done(req: GenRequest) -> None:
    async for _ in req.follow():
        pass


class Full:
    """The engine's KV control with no capacity for now: every request stays queued."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def admit(self, *args, **kwargs):
        raise errors.CapacityError("no capacity (test)", {})


@pytest.mark.slow
@pytest.mark.parametrize("revive", [True, False], ids=["revived-waiting", "lost"])
def test_a_request_lost_with_its_service_survives_an_engine_kill_after_the_reattach(
    service, tmp_path, revive
):
    """A request failed with its KV service, the engine re-attached, and then killed (the file
    as it is on disk): revived and waiting for admission again, the restarted engine queues it
    again; not revived yet (no resume came), it keeps it lost and does not run it, until a resume
    revives it. Either way it prefills its prompt and tokens again and continues as the
    uninterrupted run."""
    path = str(tmp_path / "engine.state")
    cfg = engine_config("service", service, state_file=path)

    async def run() -> tuple[list[int], GenRequest, bool, GenRequest]:
        engine = await build_engine(cfg)
        engine.start()
        reference = engine.api.submit(PROMPT, NEW, SamplingParams())
        await _done(reference)
        lost = engine.api.submit(PROMPT, NEW, SamplingParams())
        async for event in lost.follow():
            if event.index == 2:  # the client sees the service go (its stream broke)
                engine.control.recovery.die(errors.ServiceUnavailable("the service is gone"))
                break
        await asyncio.wait_for(engine.recovered.wait(), 30)
        if revive:
            lost = engine.api.resume(lost.request_id)
        on_disk = open(path).read()  # what a kill -9 leaves: nothing is flushed after this
        await engine.stop(keep_requests=True)
        with open(path, "w") as f:
            f.write(on_disk)
        again = await build_engine(cfg)
        held = lost.request_id in again.finished and lost.request_id not in again.requests
        again.start()
        try:
            back = again.api.resume(lost.request_id)
            await _done(back)
        finally:
            await again.stop()
        return reference.tokens, lost, held, back

    reference, lost, held, back = asyncio.run(run())
    if revive:
        assert lost.replayed >= 3 and lost.tokens == reference[: lost.replayed]
    assert held is not revive  # a lost one waits for its client's resume
    assert back.finish is Finish.LENGTH, back.error
    assert back.tokens == reference


@pytest.mark.slow
def test_a_cancelled_queued_request_is_not_run_again_after_a_kill(service, tmp_path):
    """A queued request cancelled by its client, its end taken in by the engine, then the
    engine killed before any step wrote the file: the restarted engine must not run it."""
    path = str(tmp_path / "engine.state")

    async def run() -> tuple[str, state_file.SavedState]:
        engine = await build_engine(engine_config("service", service, state_file=path))
        engine.set_control(Full(engine.control))
        engine.start()
        try:
            req = engine.api.submit(PROMPT, NEW, SamplingParams())
            await wait_until(lambda: engine.scheduler.refused)
            engine.api.cancel(req)
            await wait_until(lambda: req.request_id in engine.finished)
            return req.request_id, state_file.load(path)  # before stop() flushes the file
        finally:
            await engine.stop()

    rid, kept = asyncio.run(run())
    assert rid not in kept.requests

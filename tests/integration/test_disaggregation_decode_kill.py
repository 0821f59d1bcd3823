"""A decode side killed mid-transfer, through real processes over NIXL UCX on CPU (issue 42):
the prefill engine drops its transfer state and serves the next decode side.

Each decode side is a KV service (--nixl, its segments on /dev/shm as on a GPU node) and a
decode engine with the one prefill engine as its peer. To kill a side while a prompt is on its
way, the prefill engine is stopped (SIGSTOP) before the prompt is sent and continued after the
kill, so the order does not depend on timing:
1. the service killed (SIGKILL) while its engine waits for the prompt: the prefill engine
   computes it and its write finds the service's agent gone; the export is dropped;
2. the whole side killed (engine and service) with the prompt's call on its way: whatever of
   it reached the prefill engine is dropped, and the dead side's agent, loaded by its first
   prompt, is forgotten once idle (--transfer-peer-idle, 1 s here; a side that dies between
   prompts tells nobody);
after each, the prefill engine holds nothing for the dead side: no prompt, export, write or
NIXL peer, only its own cache's regions, no request or page but cached ones, and it maps or
opens no file of the dead service and no /dev/shm file it did not map before (UCX's own);
3. a new decode side gets the tokens of a single node (an engine of role both on its service),
   and its service holds no request afterwards.
Skipped without the nixl package."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from contract.nixl_agent import nixl_available
from engine_client.cli.config import GenerateConfig
from engine_client.serve.procs import ManagedProcess
from tests.process_harness import (
    cuda_shm_dir,
    decode_role,
    generated,
    prefill_status,
    settled,
    start_engine,
    start_service,
    workdir,
)

if not nixl_available():
    pytest.skip("the nixl package is not installed", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Shorter than a prefill chunk (32 tokens, the reuse grain): never cached on either side.
WARM = GenerateConfig(target="", prompt=tuple(range(60, 77)), max_new_tokens=3, timeout=60)
PROMPT = GenerateConfig(
    target="", prompt=tuple((7 * i) % 300 + 5 for i in range(21)), max_new_tokens=8, timeout=60
)
SHM = "/dev/shm"


def _until(holds: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll another process's state until it holds (no fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not holds():
        assert time.monotonic() < deadline, f"not in {timeout:g} s: {what}"
        time.sleep(0.05)


def _shm_held(pid: int) -> set[str]:
    """The /dev/shm files a process maps or has open (unlinked ones too)."""
    held = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                held.add(fields[5].strip().removesuffix(" (deleted)"))
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held.add(os.readlink(f"/proc/{pid}/fd/{fd}").removesuffix(" (deleted)"))
        except OSError:
            continue
    return {p for p in held if p.startswith(SHM + "/")}


@contextmanager
def _stopped(proc: ManagedProcess) -> Iterator[None]:
    proc.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.signal(signal.SIGCONT)


class _DecodeSide:
    """A service with --nixl and a decode engine whose peer is the prefill engine."""

    def __init__(self, path: str, prefill: ManagedProcess, name: str) -> None:
        self.shm = cuda_shm_dir(path)
        self.svc = start_service(path, extra=("--nixl", "1"), shm_dir=self.shm)
        peer = decode_role(prefill.target)
        self.decode = start_engine(path, "service", self.svc, name=f"decode-{name}", extra=peer)
        self._sent = 0

    def generate(self, cfg: GenerateConfig) -> list[int]:
        self._sent += 1
        return asyncio.run(generated(self.decode, cfg))

    def send_while_stopped(self, prefill: ManagedProcess, kill: Callable[[], None]) -> None:
        """Send PROMPT with the prefill engine stopped, `kill` once the decode engine has
        sent it to the peer, then let the prefill engine go on."""
        self._sent += 1
        caller = threading.Thread(target=self._generate_quietly, daemon=True)
        with _stopped(prefill):
            caller.start()
            log = lambda: self.decode.log(None).count("sent to prefill peer")  # noqa: E731
            _until(lambda: log() == self._sent, "the prompt sent to the prefill engine")
            kill()
        caller.join(60)

    def _generate_quietly(self) -> None:
        try:
            asyncio.run(generated(self.decode, PROMPT))
        except Exception:  # the side is killed under it: the error is not what is tested
            pass

    def stop(self) -> None:
        self.decode.stop()
        self.svc.stop()


def _assert_nothing_held(prefill: ManagedProcess, own_shm: set[str], dead: _DecodeSide) -> None:
    def idle() -> bool:
        s = prefill_status(prefill)
        busy = (s.prompts, s.exports_pending, s.writes, len(s.peers), s.requests)
        return busy == (0, 0, 0, 0, 0) and s.pages_used == s.cached_pages

    _until(idle, f"the prefill engine idle: {prefill_status(prefill)}")
    status = prefill_status(prefill)
    assert sorted(status.regions) == ["index", "rows"] and status.memory_type == "DRAM"
    held = _shm_held(prefill.pid)
    dead_files = {os.path.join(dead.shm, n) for n in dead.svc.segment_files()}
    assert not held & dead_files, held & dead_files
    assert held == own_shm, (held, own_shm)  # UCX's own segments, none of a peer's
    ours = [n for n in os.listdir(SHM) if f"-{prefill.pid}-" in n or f"_{prefill.pid}_" in n]
    assert not ours, ours
    assert prefill.alive(), prefill.log()


def test_a_decode_side_killed_mid_transfer_leaves_nothing_on_the_prefill_side() -> None:
    with workdir("hsk") as path:
        role = ("--role", "prefill", "--transfer-peer-idle", "1")
        prefill = start_engine(path, "baseline", name="prefill", extra=role)
        own_shm = _shm_held(prefill.pid)
        sides = []
        try:
            a = _DecodeSide(path, prefill, "a")
            sides.append(a)
            a.generate(WARM)  # the prefill engine loads a's agent; a caches its target
            a.send_while_stopped(prefill, a.svc.kill)
            _until(lambda: prefill_status(prefill).exports_dropped == 1, "the export dropped")
            assert "prefill of" in prefill.log(None), prefill.log()
            a.decode.kill()
            _assert_nothing_held(prefill, own_shm, a)
            assert prefill_status(prefill).exports_written == 1

            b = _DecodeSide(path, prefill, "b")
            sides.append(b)
            b.generate(WARM)

            def kill_b() -> None:
                b.decode.kill()
                b.svc.kill()

            b.send_while_stopped(prefill, kill_b)
            _assert_nothing_held(prefill, own_shm, b)

            c = _DecodeSide(path, prefill, "c")
            sides.append(c)
            single = start_engine(path, "service", c.svc, name="single")
            try:
                want = asyncio.run(generated(single, PROMPT))
            finally:
                assert single.stop() == 0, single.log()
            assert c.generate(PROMPT) == want, c.decode.log()
            assert asyncio.run(settled(c.svc))
            assert prefill_status(prefill).exports_written == 3
            _until(lambda: not prefill_status(prefill).peers, "c's agent forgotten once idle")
        finally:
            for side in sides:
                side.stop()
            assert prefill.stop() == 0, prefill.log()

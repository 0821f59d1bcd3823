"""A prefill peer killed mid-transfer, through real processes over NIXL UCX on CPU (issue 42):
the decode engine has three peers (`--prefill-peer` comma-separated and repeated): two that
write garbage into part of the request's pages and die at once (tests/integration/
dying_prefill_peer.py), and a real prefill engine.
- The first prompt goes to a dying peer: the decode side passes it to the next peer, the real
  engine, which writes every page again; the tokens are a single node's.
- The real engine is then killed (SIGKILL) and the next prompt goes to the second dying peer:
  with no peer left the decode engine prefills the prompt itself, over the garbage; the tokens
  are a single node's again.
- Every page and slot is free afterwards (the conftest checks /dev/shm and the children).
Skipped without the nixl package."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from contract.nixl_agent import nixl_available
from engine_client.cli.config import GenerateConfig
from engine_client.serve.procs import ENGINE_SERVICE_NAME, ManagedProcess
from tests.process_harness import (
    decode_role,
    generated,
    settled,
    start_engine,
    start_service,
    workdir,
)

if not nixl_available():
    pytest.skip("the nixl package is not installed", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FIRST = GenerateConfig(target="", prompt=tuple(range(40, 61)), max_new_tokens=6, timeout=120)
# Offloaded (19 + 40 tokens past the 32 hot slots): the local prefill fills the host pages.
SECOND = GenerateConfig(target="", prompt=tuple(range(90, 109)), max_new_tokens=40, timeout=120)


def _dying_peer(path: str, name: str) -> ManagedProcess:
    sock = os.path.join(path, f"{name}.sock")
    args = [sys.executable, "-m", "tests.integration.dying_prefill_peer", sock]
    log = os.path.join(path, f"{name}.log")
    proc = ManagedProcess(name, args, log, f"unix:{sock}", ENGINE_SERVICE_NAME)
    return proc.start().wait_serving(60)


def test_a_peer_killed_mid_transfer_leaves_the_tokens_of_a_single_node() -> None:
    with workdir("hsf") as path:
        svc = start_service(path, extra=("--nixl", "1"))
        real = start_engine(path, "baseline", name="prefill", extra=("--role", "prefill"))
        dying = [_dying_peer(path, f"dying{i}") for i in range(2)]
        # The flag repeated extends the list (contract/flags.py).
        peers = (*decode_role(dying[0].target, real.target), "--prefill-peer", dying[1].target)
        decode = start_engine(path, "service", svc, name="decode", extra=peers)
        single = start_engine(path, "service", svc, name="single")
        try:
            want = asyncio.run(generated(single, FIRST))
            assert asyncio.run(generated(decode, FIRST)) == want, decode.log()
            assert dying[0].proc.wait(30) != 0 and "garbage" in dying[0].log()
            assert f"prefilled by {real.target}" in decode.log(None)

            real.kill()
            want = asyncio.run(generated(single, SECOND))
            assert asyncio.run(generated(decode, SECOND)) == want, decode.log()
            assert dying[1].proc.wait(30) != 0 and "garbage" in dying[1].log()
            assert "no prefill peer took it" in decode.log(None)
            assert asyncio.run(settled(svc))
        finally:
            for eng in (decode, single):
                assert eng.stop() == 0, eng.log()
            for proc in (real, *dying):
                proc.stop()
            svc.stop()

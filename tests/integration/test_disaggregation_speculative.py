"""Speculative decoding (--speculative mtp) with prefill/decode disaggregation over NIXL UCX,
through real processes on CPU. The prefill engine runs the MTP layer too: the layer's KV rows
travel as the layout's last layer, and its drafts after the first token come back in the reply;
the decode engine writes them into the request's slot before its first verify step.

Drafts are accepted by the BENCHMARK-ONLY synthetic rule (a seeded draw per draft position,
keyed by the request), so the tokens depend on the drafts that land and on the rule's key: with
the previous request's drafts left in the slot (or no key), the first verify step accepts other
tokens and the stream differs. Greedy tokens equal a single-node speculative engine's on the same
service, for a resident and an offloaded request, one after the other through the same slots,
and every page is free again afterwards; on CPU and on one GPU (two processes on the device).
Skipped without the nixl package."""

from __future__ import annotations

import asyncio

import pytest

from contract import flags
from contract.nixl_agent import nixl_available
from engine_client.cli.config import GenerateConfig
from tests.integration.test_engine_speculative import SPEC_LAYOUT, SPEC_LOCAL
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# D = 2, steps accepting 0, 1 or 2 drafts (rates of the second given the first).
SPECULATIVE = (
    *("--speculative", "mtp", "--draft-tokens", "2"),
    *("--speculative-acceptance", "0.8,0.6", "--allow-benchmark-only", "1"),
)
# 20 + 10 tokens fit the 72 hot slots (resident); 64 + 12 do not (offloaded: misses read
# from the host pages the prefill engine wrote); AGAIN runs in a slot that held drafts before.
RESIDENT = GenerateConfig(target="", prompt=tuple(range(30, 50)), max_new_tokens=10, timeout=300)
AGAIN = GenerateConfig(target="", prompt=tuple(range(140, 158)), max_new_tokens=9, timeout=300)
OFFLOADED = GenerateConfig(
    target="", prompt=tuple((7 * i) % 250 + 1 for i in range(64)), max_new_tokens=12, timeout=300
)


def test_a_speculative_decode_engine_lands_the_prefill_peers_drafts() -> None:
    with workdir("hsm") as path:
        svc = start_service(path, SPEC_LAYOUT, extra=("--nixl", "1"))
        local = flags.to_flags(SPEC_LOCAL)  # the prefill engine's own cache, MTP layer included
        prefill = start_engine(
            path, "baseline", name="prefill", extra=(*local, "--role", "prefill", *SPECULATIVE)
        )
        decode = start_engine(
            path, "service", svc, name="decode", extra=(*decode_role(prefill.target), *SPECULATIVE)
        )
        single = start_engine(path, "service", svc, name="single", extra=SPECULATIVE)
        try:
            for cfg in (RESIDENT, OFFLOADED, AGAIN):
                # The decode engine first: a prompt the single node ran would be cached on the
                # service, and the decode engine would prefill it itself.
                got = asyncio.run(generated(decode, cfg))
                assert len(got) == cfg.max_new_tokens
                assert asyncio.run(generated(single, cfg)) == got, (decode.log(), prefill.log())
            assert decode.log().count("prefilled by") == 3
            assert asyncio.run(settled(svc))
        finally:
            for eng in (decode, single, prefill):
                assert eng.stop() == 0, eng.log()
            svc.stop()

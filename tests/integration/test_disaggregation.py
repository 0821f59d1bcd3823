"""Prefill/decode disaggregation over NIXL UCX, through real processes on CPU (issue 42): a KV
service with --nixl, a prefill engine (--role prefill, its own baseline cache) and a decode
engine (--role decode) on that service. The prefill engine writes each prompt's rows and index
keys into the decode side's pages; the decode engine decodes from there. Greedy tokens equal a
single-node engine's on the same service, for a resident and an offloaded request and for a
prompt mostly cached on the decode side (prefilled there, not sent), and every page and request
slot is free again afterwards. Two prefill and two decode engines share four prompts at once.
Skipped without the nixl package."""

from __future__ import annotations

import asyncio

import pytest

from contract.nixl_agent import nixl_available
from engine_client.cli.config import GenerateConfig
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

PROMPT = tuple((7 * i) % 300 + 5 for i in range(21))
# 21 + 8 tokens fit the 32 hot slots (resident); 21 + 40 are offloaded: the window ring is
# loaded from the written host pages and older rows are misses read from them.
RESIDENT = GenerateConfig(target="", prompt=PROMPT, max_new_tokens=8, timeout=120)
OFFLOADED = GenerateConfig(target="", prompt=PROMPT[:19], max_new_tokens=40, timeout=120)
# Its first 32 tokens (one prefill chunk, the reuse grain) are cached once the single node has
# run it: 32 of 40 is over LOCAL_SHARE, so the decode engine prefills it itself.
CACHED = GenerateConfig(target="", prompt=tuple(range(200, 240)), max_new_tokens=4, timeout=120)


# The transfer sources (engine_client.kv.export_source): the cache itself, the pinned host
# staging buffer a GPU falls back to, and the buffer beside the cache (on CPU both are an extra
# copy, page-major: the same bytes in fewer spans).
@pytest.mark.parametrize(
    "row_format,source", [("bf16", "direct"), ("fp8", "staged"), ("bf16", "gathered")]
)
def test_one_prefill_and_one_decode_give_the_single_node_tokens(row_format, source) -> None:
    from tests.process_harness import layout_with

    layout = layout_with(row_format=row_format, index_format=row_format)
    with workdir("hsd") as path:
        svc = start_service(path, layout, extra=("--nixl", "1"))
        formats = ("--row-format", row_format, "--index-format", row_format)
        role = ("--role", "prefill", "--transfer-source", source)
        prefill = start_engine(path, "baseline", name="prefill", extra=(*role, *formats))
        decode = start_engine(
            path, "service", svc, name="decode", extra=decode_role(prefill.target)
        )
        single = start_engine(path, "service", svc, name="single")
        try:
            for cfg in (RESIDENT, OFFLOADED):
                want = asyncio.run(generated(single, cfg))
                got = asyncio.run(generated(decode, cfg))
                assert len(want) == cfg.max_new_tokens
                assert got == want, (cfg.max_new_tokens, decode.log(), prefill.log())
            assert "prefilled by" in decode.log()
            want = asyncio.run(generated(single, CACHED))
            assert asyncio.run(generated(decode, CACHED)) == want
            assert "prefilled here: 32 of its 40 prompt tokens are cached" in decode.log()
            assert asyncio.run(settled(svc))
        finally:
            for eng in (decode, single, prefill):
                assert eng.stop() == 0, eng.log()
            svc.stop()


def test_two_prefill_and_two_decode_engines_share_the_prompts() -> None:
    """Both decode engines list both prefill engines; four prompts at once (two per decode
    engine, round-robin) are prefilled by both peers and decode to a single node's tokens."""
    with workdir("hsd") as path:
        svc = start_service(path, extra=("--nixl", "1"))
        prefills = [
            start_engine(path, "baseline", name=f"prefill{i}", extra=("--role", "prefill"))
            for i in range(2)
        ]
        peers = decode_role(*(p.target for p in prefills))
        decodes = [
            start_engine(path, "service", svc, name=f"decode{i}", extra=peers) for i in range(2)
        ]
        single = start_engine(path, "service", svc, name="single")
        try:
            want = [asyncio.run(generated(single, cfg)) for cfg in (RESIDENT, OFFLOADED)]

            async def everything() -> list[list[int]]:
                calls = [generated(d, cfg) for d in decodes for cfg in (RESIDENT, OFFLOADED)]
                return list(await asyncio.gather(*calls))

            assert asyncio.run(everything()) == want * 2
            for p in prefills:
                assert sum(f"prefilled by {p.target}" in d.log(None) for d in decodes) == 2
            assert asyncio.run(settled(svc))
        finally:
            for eng in (*decodes, single, *prefills):
                assert eng.stop() == 0, eng.log()
            svc.stop()

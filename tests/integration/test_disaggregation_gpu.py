"""Prefill/decode disaggregation on one GPU (issue 42 item 5): a prefill engine and a decode
engine as two processes on the same device, the prefill engine's cache in device memory
registered with NIXL as VRAM, its rows written straight into the decode side's pinned host
pages (GPU -> host over UCX), or staged through pinned host memory first (the default). Greedy
tokens equal those of an engine of role both on the same service, bit for bit, for a resident
and an offloaded request, in both row formats; every page and slot is free afterwards. Skipped
without CUDA or the nixl package."""

from __future__ import annotations

import asyncio

import pytest

from contract.nixl_agent import nixl_available
from engine_client.cli.config import GenerateConfig
from tests.process_harness import (
    decode_role,
    generated,
    layout_with,
    prefill_status,
    settled,
    start_engine,
    start_service,
    workdir,
)

if not nixl_available():
    pytest.skip("the nixl package is not installed", allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = tuple((7 * i) % 300 + 5 for i in range(21))
# 21 + 8 tokens fit the 32 hot slots (resident); 19 + 40 are offloaded.
RESIDENT = GenerateConfig(target="", prompt=PROMPT, max_new_tokens=8, timeout=300)
OFFLOADED = GenerateConfig(target="", prompt=PROMPT[:19], max_new_tokens=40, timeout=300)


# direct: the cache itself, a span per layer and page; gathered: a page-major copy of the
# request's pages beside it on the device (both VRAM); auto, the default: staged on a GPU, a
# page-major copy in pinned host memory (DRAM).
@pytest.mark.parametrize(
    "row_format,source",
    [("bf16", "direct"), ("fp8", "direct"), ("bf16", "gathered"), ("fp8", "auto")],
)
def test_a_prefill_gpu_writes_straight_into_the_decode_sides_host_pages(row_format, source) -> None:
    layout = layout_with(row_format=row_format, index_format=row_format)
    formats = ("--row-format", row_format, "--index-format", row_format)
    with workdir("hsg") as path:
        svc = start_service(path, layout, device="cuda", extra=("--nixl", "1"))
        role = ("--role", "prefill", "--transfer-source", source, *formats)
        prefill = start_engine(path, "baseline", name="prefill", extra=role, device="cuda")
        peer = decode_role(prefill.target)
        decode = start_engine(path, "service", svc, name="decode", extra=peer, device="cuda")
        single = start_engine(path, "service", svc, name="single", device="cuda")
        try:
            memory = "DRAM" if source == "auto" else "VRAM"
            assert prefill_status(prefill).memory_type == memory, prefill.log()
            for cfg in (RESIDENT, OFFLOADED):
                want = asyncio.run(generated(single, cfg))
                got = asyncio.run(generated(decode, cfg))
                assert len(want) == cfg.max_new_tokens
                assert got == want, (cfg.max_new_tokens, decode.log(), prefill.log())
            status = prefill_status(prefill)
            assert status.exports_written == 2 and status.exports_dropped == 0, status
            assert status.bytes_written > 0 and "prefilled by" in decode.log(None)
            assert asyncio.run(settled(svc))
        finally:
            for eng in (decode, single, prefill):
                assert eng.stop() == 0, eng.log()
            svc.stop()

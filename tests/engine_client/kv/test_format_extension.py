"""Adding a KV row format is one object plus its kernels (docs/ARCHITECTURE.md).

This test defines a row format of its own, registered only while it runs: bf16 rows padded to a
larger row with a fixed byte pattern (an alignment padding a real format might want), with a
reference codec and no Triton variant, so it runs on the reference kernels. Nothing else in the
repository knows it, yet the whole CPU path takes it: the engine's local layout (flags and
validation), the service core's memory, appends into the host tier and hot buffers, the swap-in
plan and miss copy, the prefill gather and attention, in the embedded and baseline modes. Its
rows decode to the same bf16 values as the bf16 format, so every token and logit must equal the
bf16 format's, bit for bit.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from contract.layout import ROW_FORMATS, KVLayout
from engine_client.kv.baseline import BaselineBackend
from engine_client.kv.hisparse import HiSparseBackend
from engine_client.loop.request import SamplingParams
from engine_client.serve.factory import build_engine
from kernels.formats import ROW_VALUES, RowFormat
from kernels.kit.kernel_set import KernelSet
from kernels.store.append import kv_append
from kv_service.memory.store import allocate_local
from tests.process_harness import LAYOUT, engine_config

BF16_BYTES = 2 * ROW_VALUES
PAD, PAD_BYTES = 0xA5, 128


def encode_padded(rows: torch.Tensor, out: torch.Tensor) -> None:
    out[:, :BF16_BYTES] = rows.to(torch.bfloat16).contiguous().view(torch.uint8)
    out[:, BF16_BYTES:] = PAD


def decode_padded(raw: torch.Tensor) -> torch.Tensor:
    return raw[..., :BF16_BYTES].contiguous().view(torch.bfloat16)


PADDED = RowFormat(
    "bf16pad", BF16_BYTES + PAD_BYTES, "uint8", encode_padded, decode_padded, kernel=None
)


@pytest.fixture
def padded_format(monkeypatch):
    monkeypatch.setitem(ROW_FORMATS, PADDED.name, PADDED)
    return PADDED


# (prompt, max_new_tokens): resident, and offloaded past the 32 hot slots (misses, host tier).
JOBS = [(tuple(range(3, 15)), 6), (tuple((7 * i) % 250 + 1 for i in range(40)), 8)]


async def tokens_and_logits(cfg) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    engine = await build_engine(cfg)
    logits: list[torch.Tensor] = []
    step = engine.compute.model_runner.step

    def recording_step(*args):
        logits.append(step(*args).clone())
        return logits[-1]

    engine.compute.model_runner.step = recording_step
    reqs = [engine.api.submit(p, n, SamplingParams()) for p, n in JOBS]
    engine.start()
    try:
        for req in reqs:
            async for _ in req.follow():
                pass
        return [r.tokens for r in reqs], logits, dict(engine.totals)
    finally:
        await engine.stop()


@pytest.mark.timeout(300)
def test_a_format_defined_here_runs_the_engine_end_to_end(padded_format) -> None:
    runs = {
        (fmt, mode): asyncio.run(
            tokens_and_logits(engine_config(mode, row_format=fmt, kernels="reference"))
        )
        for fmt in ("bf16", padded_format.name)
        for mode in ("embedded", "baseline")
    }
    base_tokens, base_logits, _ = runs["bf16", "baseline"]
    assert [len(t) for t in base_tokens] == [n for _, n in JOBS]
    for key, (tokens, logits, totals) in runs.items():
        assert tokens == base_tokens, key
        assert all(torch.equal(a, b) for a, b in zip(logits, base_logits, strict=True)), key
        if key[1] == "embedded":
            assert totals["misses"] > 0, key  # the offloaded request read the host tier
    embedded = runs[padded_format.name, "embedded"][2]
    assert embedded["bytes_moved"] == embedded["misses"] * padded_format.row_bytes


def test_its_rows_are_stored_in_its_own_bytes(padded_format) -> None:
    layout = KVLayout(**(LAYOUT.to_dict() | {"row_format": padded_format.name}))
    assert layout.row is padded_format and layout.row_bytes == BF16_BYTES + PAD_BYTES
    kernels = KernelSet.reference()
    kv = allocate_local(layout)
    kv.req_mode[0] = 1  # resident: token t at hot slot t
    kv.page_table[0, 0] = 0
    backends = [HiSparseBackend(kv, kernels=kernels), BaselineBackend(layout, kernels=kernels)]
    rows = torch.randn(3, ROW_VALUES).bfloat16()
    keys = layout.index.encode(torch.randn(3, 128))
    cols = [torch.tensor(c, dtype=torch.int32) for c in ([0, 0, 0], [0, 1, 2], [3, 3, 3])]
    for backend in backends:
        backend.append(1, rows, keys, *cols)
    stored = kv.hot_kv[1, 0, :3]
    assert stored.shape[-1] == padded_format.row_bytes
    assert (stored[:, BF16_BYTES:] == PAD).all()
    assert torch.equal(padded_format.dequantize(stored), rows)
    assert torch.equal(backends[1].full_kv[1, 0, :3], stored)
    # The Triton kernels have no variant for it, and say so instead of writing wrong bytes.
    with pytest.raises(ValueError, match="no Triton kernel"):
        kv_append(
            1,
            rows,
            keys,
            *cols,
            kv.req_mode,
            kv.page_table,
            kv.host_rows,
            kv.hot_kv,
            kv.index_pool,
            window=layout.window,
            row_format=layout.row,
            index_format=layout.index,
        )

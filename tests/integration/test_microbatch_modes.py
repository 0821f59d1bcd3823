"""Decode micro-batches (the side-stream miss copy) in every KV mode on CUDA: each engine
captures its decode graphs for every batch bucket (1, 2, 4: a batch of 1 is a single part)
and replays them; tokens and logits equal the baseline without micro-batches, bit for bit."""

from __future__ import annotations

import asyncio

import pytest
import torch

from contract import setting_groups
from tests.engine_client.loop.test_engine import MODES, _run_jobs
from tests.process_harness import engine_config, flush, layout_with, start_service, workdir

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_every_mode_captures_and_replays_with_microbatches(row_format) -> None:
    with workdir() as path:
        svc = start_service(path, layout_with(row_format=row_format), device="cuda")
        try:

            def run(mode: str, microbatches: int):
                # A run's finished prompts stay cached in the service: the next run would
                # prefill less and batch differently, so every run starts from an empty cache.
                flush(svc)
                cfg = engine_config(
                    mode,
                    svc if "service" in mode else None,
                    row_format=row_format,
                    decode_microbatches=microbatches,
                )
                return asyncio.run(_run_jobs(setting_groups.replace(cfg, device="cuda")))

            base_tokens, base_logits, _ = run("baseline", 1)
            for mode in MODES:
                tokens, logits, totals = run(mode, 2)
                assert tokens == base_tokens, mode
                assert len(logits) == len(base_logits), mode
                assert all(torch.equal(a, b) for a, b in zip(logits, base_logits)), mode
                if mode != "baseline":
                    assert totals["misses"] > 0, mode
        finally:
            assert svc.stop() == 0, svc.log()

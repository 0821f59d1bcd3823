"""--decode-part-tail 1 through the real engine (factory.build_engine) in every KV mode, the
service modes against a real `python -m kv_service` subprocess: every mode's model splits its
decode tail into the --decode-microbatches parts (the baseline's and remote swap's backends
attend in one part), and tokens and logits equal the baseline's with the same settings, bit for
bit. CPU (reference kernels, eager) and CUDA (Triton, graphs captured and replayed)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from contract import setting_groups
from engine_client.serve.factory import build_engine
from tests.engine_client.loop.test_engine import (  # noqa: F401 (one_cpu_thread: autouse)
    JOBS,
    MODES,
    _drive,
    one_cpu_thread,
    record_logits,
)
from tests.process_harness import engine_config, flush, layout_with, start_service, workdir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def _run(cfg) -> tuple[list[list[int]], list[torch.Tensor], int, dict]:
    """Tokens, every decode step's logits, the model's tail parts and the engine's totals."""
    engine = await build_engine(cfg)
    logits, parts = record_logits(engine), engine.compute.model.tail_parts
    reqs = await _drive(engine, JOBS)
    return [r.tokens for r in reqs], logits, parts, dict(engine.totals)


def _four_modes(device: str, row_format: str) -> dict[str, tuple]:
    with workdir() as path:
        svc = start_service(path, layout_with(row_format=row_format), device=device)
        try:
            runs = {}
            for mode in MODES:
                flush(svc)  # every run starts cold: same prefills, same batches
                cfg = engine_config(
                    mode,
                    svc if "service" in mode else None,
                    row_format=row_format,
                    decode_microbatches=2,
                    decode_part_tail=True,
                )
                runs[mode] = asyncio.run(_run(setting_groups.replace(cfg, device=device)))
        finally:
            assert svc.stop() == 0, svc.log()
    return runs


def _check(runs: dict[str, tuple]) -> None:
    base_tokens, base_logits, _, _ = runs["baseline"]
    assert [len(t) for t in base_tokens] == [n for _, n, _ in JOBS]
    for mode, (tokens, logits, parts, totals) in runs.items():
        assert parts == 2, mode
        assert tokens == base_tokens, mode
        assert len(logits) == len(base_logits), mode
        assert all(torch.equal(a, b) for a, b in zip(logits, base_logits)), mode
        if mode != "baseline":
            assert totals["misses"] > 0, mode


def test_every_mode_gives_the_baselines_bits_with_the_part_tail() -> None:
    _check(_four_modes("cpu", "bf16"))


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_every_mode_captures_and_replays_with_the_part_tail(row_format) -> None:
    _check(_four_modes("cuda", row_format))

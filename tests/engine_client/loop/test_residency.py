"""Dropping a request slot's hot-buffer residency (what a restarted engine does to every request
it adopts, contract/residency.py) only costs misses: an embedded engine whose offloaded
requests lose their residency before every decode step gives the tokens and logits of an
undisturbed run, through more host reads (CPU, in-process)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from contract import residency
from engine_client.loop.request import Phase
from engine_client.serve.factory import build_engine
from tests.engine_client.loop.test_engine import JOBS, _drive
from tests.process_harness import engine_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def _run(drop: bool) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    # Without overlap every step before this one is recorded: positions [0, P) are committed,
    # P (the last token's) is appended by this step, as in the first step after a restart.
    engine = await build_engine(engine_config("embedded", overlap=False))
    kv, step, logits = engine.control.tensors, engine.compute.model_runner.step, []
    assert kv is not None

    def dropping_step(*args):
        for req in engine.requests.values():
            if drop and req.phase is Phase.RUNNING and req.tokens and req.slot >= 0:
                residency.restart(kv, req.slot, req.prompt_len + len(req.tokens) - 1)
        out = step(*args)
        logits.append(out.clone())
        return out

    engine.compute.model_runner.step = dropping_step
    reqs = await _drive(engine, JOBS)
    return [r.tokens for r in reqs], logits, dict(engine.totals)


def test_dropped_residency_costs_misses_not_logits() -> None:
    tokens, logits, totals = asyncio.run(_run(drop=False))
    tokens2, logits2, totals2 = asyncio.run(_run(drop=True))
    assert tokens2 == tokens and [len(t) for t in tokens] == [n for _, n, _ in JOBS]
    assert len(logits2) == len(logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, logits2))
    assert totals2["misses"] > totals["misses"] > 0, (totals, totals2)

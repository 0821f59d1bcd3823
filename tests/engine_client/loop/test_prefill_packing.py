"""A step carries the prefill chunks of several requests, a chunk's tokens in all
(engine_client/loop/batch.py), through the real engine in-process: short prompts arriving
together get their first tokens in fewer steps (one prefill per step made the last of N wait N
steps: issue 40, item 3), with the same tokens and logits as one prefill per step; the engine
says how long each request waited for admission and for its first prefill chunk."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine_client.loop import batch as batch_module
from engine_client.loop.batch import MAX_PREFILLS_PER_STEP, PrefillBudget, PrefillChunk
from engine_client.loop.request import Finish, GenRequest, SamplingParams
from engine_client.serve.factory import build_engine
from tests.engine_client.loop.test_engine import one_cpu_thread  # noqa: F401 (autouse fixture)
from tests.process_harness import engine_config

pytestmark = [pytest.mark.timeout(120)]

# Four 3-token prompts at once, prefill chunk 8: two chunks fit a step (3 + 3; a third would
# make 9), so the last first token comes after 2 prefill steps instead of 4.
JOBS = [((5 + i, 9, 2 + i), 3, SamplingParams(temperature=0.7 * (i % 2), seed=i)) for i in range(4)]


def _chunk(tokens: int, synthetic: bool = False) -> PrefillChunk:
    req = GenRequest("r", (1,) * tokens, 1, SamplingParams())
    return PrefillChunk(req, 0, tokens, ((0, 4, 1),) if synthetic else ())


def test_the_budget_is_a_chunks_tokens_and_the_first_always_fits() -> None:
    budget = PrefillBudget(8)
    assert budget.take(_chunk(8)) and not budget.take(_chunk(1))
    budget = PrefillBudget(8)
    assert budget.take(_chunk(20))  # one chunk alone, whatever it holds
    budget = PrefillBudget(8)
    assert budget.take(_chunk(3)) and budget.take(_chunk(5)) and not budget.take(_chunk(1))
    budget = PrefillBudget(8)
    assert budget.take(_chunk(1)) and not budget.take(_chunk(1, synthetic=True))
    budget = PrefillBudget(1 << 20)
    assert sum(budget.take(_chunk(1)) for _ in range(20)) == MAX_PREFILLS_PER_STEP


Logits = dict[tuple[int, int], torch.Tensor]


async def _run(mode: str) -> tuple[list[GenRequest], list[list[int]], Logits]:
    """The jobs submitted together: the requests, each step's prefill jobs, and every decode
    row's logits by (job, position)."""
    engine = await build_engine(engine_config(mode))
    steps: list[list[int]] = []
    logits: Logits = {}
    launch, step = engine.step_runner.launch, engine.compute.model_runner.step

    def recording_launch(batch):
        steps.append([job[c.req.request_id] for c in batch.prefills])
        return launch(batch)

    def recording_step(ids, positions, slots, *rest):
        out = step(ids, positions, slots, *rest)
        at = {r.slot: job[r.request_id] for r in engine.scheduler.requests.values()}
        for i, (slot, pos) in enumerate(zip(slots, positions)):
            logits[at[slot], pos] = out[i].clone()
        return out

    engine.step_runner.launch = recording_launch
    engine.compute.model_runner.step = recording_step
    reqs = [engine.api.submit(p, n, s) for p, n, s in JOBS]
    job = {r.request_id: i for i, r in enumerate(reqs)}
    engine.start()
    try:
        await asyncio.gather(*(_drain(r) for r in reqs))
    finally:
        await engine.stop()
    assert all(r.finish is Finish.LENGTH for r in reqs), [(r.finish, r.error) for r in reqs]
    return reqs, steps, logits


async def _drain(req: GenRequest) -> None:
    async for _ in req.follow():
        pass


@pytest.mark.parametrize("mode", ["baseline", "embedded"])
def test_short_prompts_share_prefill_steps_with_unchanged_bits(mode: str, monkeypatch) -> None:
    reqs, steps, logits = asyncio.run(_run(mode))
    assert [s for s in steps if s][:2] == [[0, 1], [2, 3]]
    monkeypatch.setattr(batch_module, "MAX_PREFILLS_PER_STEP", 1)  # one prefill per step
    alone, alone_steps, alone_logits = asyncio.run(_run(mode))
    assert [s for s in alone_steps if s][:4] == [[0], [1], [2], [3]]
    assert [r.tokens for r in reqs] == [r.tokens for r in alone]
    assert logits.keys() == alone_logits.keys() and len(logits) == 4 * 2
    assert all(torch.equal(logits[k], alone_logits[k]) for k in logits)


def test_waits_are_stamped_in_order() -> None:
    reqs, _, _ = asyncio.run(_run("baseline"))
    for r in reqs:
        assert r.started <= r.admitted_at <= r.prefill_at <= r.times[0]
        queued, prefill_wait = r.waits_us()
        assert queued >= 0 and prefill_wait >= 0
    # The two requests of the second prefill step waited for the first step's.
    assert reqs[3].prefill_at > reqs[0].prefill_at

"""The overlap churn's machinery (tests/integration/test_engine_stress.py says what it does and
which STRESS_* settings it reads; tests/integration/test_engine_stress_speculative.py runs it
under speculative steps): the engine's requests arrive, end every way and are cancelled at
every step, while the checks below watch each release, admission and finished step."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from contract import setting_groups
from contract.layout import KVLayout
from engine_client.loop.request import Finish, SamplingParams
from engine_client.serve.config import EngineConfig
from engine_client.serve.factory import build_engine
from engine_client.serve.settings.local_layout import LocalLayout
from tests.integration.churn_watch import (
    check_steps,
    depths_seen,
    ended_right,
    watch_slots,
    watch_steps,
)
from tests.process_harness import LAYOUT, LOCAL, engine_config, start_service, wait_until, workdir
from tests.service_harness import ServiceProcess

MODES = ["embedded", "baseline", "service", "service-remote-swap"]
NO_CACHING = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1"
WAYS_OUT = (Finish.STOP, Finish.LENGTH, Finish.CANCELLED)
# STRESS_QUICK_ENDS=1: the way out each request is made to take, in turn (_planned_round).
PLANNED = (Finish.CANCELLED, Finish.STOP, Finish.LENGTH)


def _min_ends() -> int:
    return int(os.environ.get("STRESS_MIN_ENDS", 3))


def _quick_ends() -> bool:
    return os.environ.get("STRESS_QUICK_ENDS") == "1"


def _layers() -> int | None:
    """The model's layers (None: the harness's), the service's layout included."""
    value = os.environ.get("STRESS_LAYERS")
    return int(value) if value else None


@dataclasses.dataclass(frozen=True)
class Churn:
    """What a churn runs: plain steps, or speculative ones (tests/integration/
    test_engine_stress_speculative.py: the MTP layer drafts `draft_tokens`, the BENCHMARK-ONLY
    synthetic rule accepts them at `rates`) on a layout whose hot slots hold their D + 1 rows'
    union (`local`). Prompts reach 8 tokens past the hot slots, so long ones are offloaded."""

    local: LocalLayout = LOCAL
    draft_tokens: int = 0
    rates: tuple[float, ...] | None = None
    prefill_chunk: int = 8  # prompt tokens per step, over all of its prefill chunks
    # Random rounds' prompts start with one of these (prefix sharing; none: all random).
    prefixes: tuple[tuple[int, ...], ...] = ()
    # watch(engine, service or None): more checks, its step() after each finished step, end()
    # once every request ended, after() once the engine stopped (tests/integration/
    # churn_shared.py).
    watch: Callable[[Any, ServiceProcess | None], Any] | None = None

    def layout(self) -> KVLayout:
        """The service's: the model's layers, and the MTP layer's with speculation."""
        layers = (_layers() or LAYOUT.num_layers) + (1 if self.draft_tokens else 0)
        return self.local.layout(num_layers=layers, topk=LAYOUT.topk)

    def config(self, kv_mode: str, svc: ServiceProcess | None, device: str) -> EngineConfig:
        """Overlap and micro-batches on (their defaults), CUDA graphs unless NO_CACHING."""
        spec = {
            "speculative": "mtp",
            "draft_tokens": self.draft_tokens,
            "speculative_acceptance": self.rates,
            "allow_benchmark_only": True,
        }
        # A shared hot region and host reads are the embedded engine's own layout's; the
        # service modes' are the service's (its layout: `layout()`), the baseline has neither.
        local = (
            self.local
            if kv_mode == "embedded"
            else dataclasses.replace(self.local, shared_slots=0, host_reads=False)
        )
        return setting_groups.replace(
            engine_config(kv_mode, svc, max_queue_wait=0),
            device=device,
            cuda_graphs=not NO_CACHING,
            num_layers=_layers(),
            local=local,
            prefill_chunk=self.prefill_chunk,
            **(spec if self.draft_tokens else {}),
        )


PLAIN = Churn()


@contextlib.contextmanager
def _service(kv_mode: str, device: str, churn: Churn) -> Iterator[ServiceProcess | None]:
    """A real service process for the service modes, stopped cleanly at the end."""
    if not kv_mode.startswith("service"):
        yield None
        return
    with workdir("hss") as path:
        unset = ("PYTORCH_NO_CUDA_MEMORY_CACHING",)
        svc = start_service(path, churn.layout(), device=device, unset=unset)
        try:
            yield svc
        finally:
            assert svc.stop() == 0, svc.log()


async def run_churn(
    kv_mode: str, device: str, steps: int, churn: Churn = PLAIN
) -> tuple[dict, dict, int]:
    """(what the KV side still holds, the requests' ends per way out, their number)."""
    began = time.perf_counter()
    with _service(kv_mode, device, churn) as svc:
        cfg = churn.config(kv_mode, svc, device)
        served = time.perf_counter()
        engine = await build_engine(cfg)
        built = time.perf_counter()
        # The planned mix's long requests reach past the hot slots: swap-ins in every mode that
        # has a host tier (baseline keeps all of its KV on the device).
        swaps = _quick_ends() and kv_mode != "baseline"
        watch = churn.watch(engine, svc) if churn.watch is not None else None
        out = await _churn_on(engine, steps, device, swaps, churn, watch)
        if watch is not None:
            watch.after()
        # bench/sanitize.sh's per-mode table reads this line: what the mode's seconds went to.
        ends = " ".join(f"{f.name.lower()} {out[1][f]}" for f in WAYS_OUT)
        print(
            f"\n@@sanitize-time {kv_mode} service {served - began:.1f} engine "
            f"{built - served:.1f} churn {time.perf_counter() - built:.1f} steps {engine.steps}"
            f" ({ends})",
            flush=True,
        )
        return out


async def _churn_on(
    engine, steps: int, device: str, swaps: bool, churn: Churn, watch: Any
) -> tuple[dict, dict, int]:
    violations, record = watch_slots(engine), watch_steps(engine)
    rng = random.Random(0)
    vocab = engine.compute.model.cfg.vocab_size
    arrive = _planned_round if _quick_ends() else _random_round
    hot, reqs = churn.local.hot_slots, []
    engine.start()
    try:
        D = engine.compute.draft_tokens
        while engine.steps < steps or (
            not (_covered(reqs) and depths_seen(record, D)) and engine.steps < 10 * steps
        ):
            arrive(engine, rng, vocab, reqs, hot, churn.prefixes)
            engine.stepped.clear()
            await engine.stepped.wait()  # one round per finished step
            if watch is not None:
                watch.step()
        for r in reqs:
            engine.api.cancel(r)
        await wait_until(lambda: not engine.requests, timeout=60)
        if watch is not None:
            await watch.end()
        if device == "cuda":
            torch.cuda.synchronize()  # an illegal address would surface here at the latest
        s = await engine.control.stats()
        # Pages still used are cached prefix pages no request uses.
        held = {
            "requests": s.requests,
            "pages_held": s.pages_used - s.evictable_pages,
            "slots_used": s.slots_used,
        }
        ends = {f: sum(r.finish is f for r in reqs) for f in Finish}
        assert violations == [], violations[:5]
        check_steps(record, D)
        wrong = [(r.finish, r.tokens, r.max_new_tokens) for r in reqs if not ended_right(r)]
        assert wrong == [], wrong[:3]
        assert not swaps or sum(r.counters.misses for r in reqs) > 0
        return held, ends, len(reqs)
    finally:
        await engine.stop()


def _random_round(
    engine, rng: random.Random, vocab: int, reqs: list, hot: int, prefixes: tuple = ()
) -> None:
    """The default round: a request of random length (up to 8 tokens past the `hot` slots;
    after one of `prefixes` if any), sampling and stop tokens arrives if the queue is short,
    and now and then a running one is cancelled."""
    head = rng.choice(prefixes) if prefixes else ()
    size = rng.randrange(1, hot + 8 - len(head))
    prompt = head + tuple(rng.randrange(1, vocab) for _ in range(size))
    sampling = SamplingParams(
        temperature=rng.choice((0.0, 0.8)),
        seed=rng.randrange(99),
        # 1 in 32 of the vocabulary (8 of the tiny preset's 256 ids when this was tuned).
        stop_token_ids=tuple(rng.sample(range(vocab), vocab // 32)),
    )
    if len(engine.waiting) < 2:  # keep the slots full, the queue short
        reqs.append(engine.api.submit(prompt, rng.randrange(1, 24), sampling))
    running = [r for r in reqs if r.tokens and not r.finished]
    if running and rng.random() < 0.2:
        engine.api.cancel(rng.choice(running))


def _planned_round(
    engine, rng: random.Random, vocab: int, reqs: list, hot: int, prefixes: tuple = ()
) -> None:
    """STRESS_QUICK_ENDS=1, for a sanitizer's slow tools (`prefixes` unused): request n is made
    to end the way PLANNED[n % 3] says, so that with STRESS_MIN_ENDS=1 every way out is taken
    by step 8 (on CPU, 30 seeds, every mode; random ends took 11 to 81 steps there, 24 under
    racecheck at ~2.8 s a step). The queue is filled to three at once, so a round's three
    requests share the first prefill steps and the steps run prefill and decode rows together
    from the start."""
    while len(engine.waiting) < len(PLANNED):
        way = PLANNED[len(reqs) % len(PLANNED)]
        reqs.append(engine.api.submit(*_planned_request(rng, vocab, way, hot)))
    for n, r in enumerate(reqs):
        if PLANNED[n % len(PLANNED)] is Finish.CANCELLED and r.tokens and not r.cancelled:
            engine.api.cancel(r)  # as soon as it has a token


def _planned_request(rng: random.Random, vocab: int, way: Finish, hot: int) -> tuple:
    """Prompt, max_new_tokens and sampling of a request made to end `way`. Cancel and stop:
    1-4 prompt tokens (one prefill step for both), up to 24 new. Stop: sampled, half the
    vocabulary its stop tokens (greedy could repeat one token that is not). Length: a prompt
    past the `hot` slots (32, plain) and 1-2 decode steps, which miss (swap-ins, remote swaps)
    in every mode with a host tier; no stop token."""
    size = rng.randrange(hot + 1, hot + 8) if way is Finish.LENGTH else rng.randrange(1, 5)
    prompt = tuple(rng.randrange(1, vocab) for _ in range(size))
    stop = way is Finish.STOP
    sampling = SamplingParams(
        temperature=0.8 if stop else rng.choice((0.0, 0.8)),
        seed=rng.randrange(99),
        stop_token_ids=tuple(rng.sample(range(vocab), vocab // 2)) if stop else (),
    )
    return prompt, rng.randrange(2, 4) if way is Finish.LENGTH else 24, sampling


def _covered(reqs: list) -> bool:
    """Every way out taken `_min_ends()` times by the requests finished so far."""
    return all(sum(r.finish is f for r in reqs) >= _min_ends() for f in WAYS_OUT)


def check(held: dict, ends: dict, n: int) -> None:
    assert held == {"requests": 0, "pages_held": 0, "slots_used": 0}
    assert ends[Finish.ERROR] == 0
    assert sum(ends.values()) == n
    # Every way out was taken, many times (the final cancels count: they end running requests).
    assert min(ends[f] for f in WAYS_OUT) >= _min_ends(), ends


def run_case(kv_mode: str, device: str, steps: int, churn: Churn = PLAIN) -> None:
    """One test case: at least `steps` steps (STRESS_STEPS overrides), then the checks. On
    CUDA the mode's marker first: bench/sanitize.sh counts what the sanitizer reports after
    it as this mode's."""
    if device == "cuda":
        print(f"\n@@sanitize-mode {kv_mode}", flush=True)
    else:
        torch.set_num_threads(1)
    steps = int(os.environ.get("STRESS_STEPS", steps))
    check(*asyncio.run(run_churn(kv_mode, device, steps, churn)))


def run_short_cpu_case(kv_mode: str, churn: Churn, monkeypatch) -> None:
    """A short CPU case of a churn variant (CI's): 30 steps, each way out twice unless
    STRESS_MIN_ENDS says (three times took 85 steps under speculation); service-remote-swap,
    the slowest on CPU (a remote swap per layer), only with STRESS_ALL_MODES=1."""
    if kv_mode == "service-remote-swap" and os.environ.get("STRESS_ALL_MODES") != "1":
        pytest.skip("service-remote-swap on CPU only with STRESS_ALL_MODES=1 (GPU: all four)")
    monkeypatch.setenv("STRESS_MIN_ENDS", os.environ.get("STRESS_MIN_ENDS", "2"))
    run_case(kv_mode, "cpu", 30, churn)

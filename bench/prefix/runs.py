"""The parts bench/prefix/cli.py runs, each on the processes of `Procs`: capacity (per top-k
source), TTFT cached vs cold (a prefix too long for the hot buffer, and one inside it), and
multi-turn conversations, with each TTFT split into the engine's queue wait, its wait behind
other prefills, and the rest (decode.v1 FinalStats)."""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

import grpc

from bench.e2e.load import LoadGen
from bench.e2e.stats import analyze
from bench.prefix import plan
from bench.prefix.children import Procs
from engine_client.cli.config import GenerateConfig
from engine_client.cli.generate import GenerationResult, generate_stream


async def stream(target: str, prompt: list[int], new: int) -> GenerationResult:
    cfg = GenerateConfig(target=target, prompt=tuple(prompt), max_new_tokens=new, timeout=900)
    result = GenerationResult()
    async with grpc.aio.insecure_channel(target) as channel:
        async for _ in generate_stream(channel, cfg, result):
            pass
    return result


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


class Rows(list):
    """A part's result rows (each part appends to the one it is given); each append also calls
    `saved`, so that the CLI rewrites its JSON after every finished run and a stage cut by its
    time limit keeps what it measured (run X1 lost a whole capacity table that way)."""

    def __init__(self, saved: Callable[[], None]) -> None:
        super().__init__()
        self.saved = saved

    def append(self, row: dict) -> None:
        super().append(row)
        self.saved()


async def capacity(p: Procs, s: plan.Sizes, load: LoadGen, vocab: int, out: list[dict]) -> None:
    """Service without and with sharing and the baseline, at one budget, per top-k source."""
    runs = plan.capacity_runs(s)
    synthetic = ["--synthetic-context", str(plan.synthetic_tokens(s, runs))]
    synthetic += ["--synthetic-shared", str(s.shared)]
    for source in s.sources:
        for r in runs:
            log(f"capacity: {r.label}, {source} top-k, {r.slots} requests")
            lay = plan.capacity_layout(s, r)
            eng = p.start(r.mode, lay, r.sharing, (*synthetic, *plan.topk_flags(source)))
            await load.run(eng.target, 1, s.prompt_len, vocab, 2, 900)  # warm-up: the prefix
            recs = await load.run(eng.target, r.slots, s.prompt_len, vocab, r.new_tokens, 900)
            res = {**asdict(r), "source": source, **analyze(recs, [], r.slots, None)}
            res["kv"], res["engine_exit"] = p.stats(), p.stop_engine()
            out.append(res)


def _timing(r: GenerationResult) -> dict:
    return {"ttft_s": r.ttft_s, "queued_s": r.queued_s, "cached": r.cached_tokens}


async def ttft(p: Procs, s: plan.Sizes, vocab: int, out: list[dict]) -> None:
    """Per mode and prefix case: pairs (cold, cached) of prompts sharing a fresh random prefix.
    `queued` of a lone request is its admission: a cached one's copies the cached rows into its
    hot buffer (all of them when resident, the window when offloaded)."""
    cases = plan.ttft_cases(s)
    ctx = max(cases.values()) + s.ttft_suffix + 4
    for mode in ("service", "baseline"):
        lay = plan.layout(s, 2, 4 * -(-ctx // s.page_size), ctx)
        eng = p.start(mode, lay, True)
        for case, shared in cases.items():
            log(f"ttft: {mode}, {case} prefix of {shared} tokens")
            rng, pairs = random.Random(1), []
            for _ in range(s.ttft_repeats):
                prefix = [rng.randrange(1, vocab) for _ in range(shared)]
                pair = []
                for _ in range(2):
                    suffix = [rng.randrange(1, vocab) for _ in range(s.ttft_suffix)]
                    pair.append(_timing(await stream(eng.target, prefix + suffix, 4)))
                pairs.append(pair)
            p50 = lambda i, k: statistics.median(c[i][k] for c in pairs)  # noqa: E731
            cold, hot = p50(0, "ttft_s"), p50(1, "ttft_s")
            out.append(
                {
                    "mode": mode,
                    "case": case,
                    "prefix": shared,
                    "pairs": pairs,
                    "cold_s": cold,
                    "cached_s": hot,
                    "ratio": hot / cold,
                    "cold_queued_s": p50(0, "queued_s"),
                    "cached_queued_s": p50(1, "queued_s"),
                }
            )
        p.stop_engine()


async def conversation(target: str, s: plan.Sizes, c: int, vocab: int) -> list[dict]:
    rng, history, turns = random.Random(1000 + c), list[int](), []
    for _ in range(s.turns):
        prompt = history + [rng.randrange(1, vocab) for _ in range(s.message)]
        r = await stream(target, prompt, s.answer)
        turns.append(
            {
                "prompt": len(prompt),
                "cached": r.cached_tokens,
                "ttft_s": r.ttft_s,
                "queued_s": r.queued_s,
                "prefill_wait_s": r.prefill_wait_s,
            }
        )
        history = prompt + r.tokens
    return turns


def turn_summary(turns: list[dict]) -> dict:
    """One turn over every conversation: prefilled tokens, and TTFT p50 with its parts' p50s
    (the engine's queue wait, the wait behind other prefills, the rest: own prefill + RPCs)."""
    p50 = lambda key: statistics.median(t[key] for t in turns)  # noqa: E731
    rest = [t["ttft_s"] - t["queued_s"] - t["prefill_wait_s"] for t in turns]
    return {
        "prefilled_mean": statistics.fmean(t["prompt"] - t["cached"] for t in turns),
        "ttft_p50_s": p50("ttft_s"),
        "queued_p50_s": p50("queued_s"),
        "prefill_wait_p50_s": p50("prefill_wait_s"),
        "rest_p50_s": statistics.median(rest),
    }


async def multiturn(p: Procs, s: plan.Sizes, vocab: int, out: list[dict]) -> None:
    ctx = s.turns * (s.message + s.answer) + s.page_size
    ppr = -(-ctx // s.page_size)
    for sharing in (False, True):
        log(f"multiturn: {s.conversations} x {s.turns}, reuse {sharing}")
        lay = plan.layout(s, s.conversations, 2 * s.conversations * ppr, ctx)
        eng = p.start("service", lay, sharing)
        t0 = time.monotonic()
        convs = await asyncio.gather(
            *(conversation(eng.target, s, c, vocab) for c in range(s.conversations))
        )
        per_turn = [turn_summary([c[t] for c in convs]) for t in range(s.turns)]
        out.append(
            {"reuse": sharing, "wall_s": time.monotonic() - t0, "turns": per_turn, "kv": p.stats()}
        )
        p.stop_engine()

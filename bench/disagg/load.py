"""The load of one run, in two parts on the decode side's engines (round-robin):
- background: `--streams` prompts at once, each decoding until the arrivals' window ends (at
  most `--tokens`): the decode side at max N for the whole window, however long TTFT is;
- arrivals: once every background stream has its first token, `--arrivals` more prompts,
  `--interval` seconds apart, each generating `--arrival-tokens`: new prompts keep arriving
  while the background decodes.
The decode ITL is the background's token gaps within the arrivals' window (first arrival sent
to last arrival done): what prefill work does to decode. TTFT is the arrivals' (under decode
load) and the background's (a burst of N prompts)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import statistics
import time
from dataclasses import dataclass

import grpc

from engine_client.cli.config import GenerateConfig
from engine_client.cli.generate import GenerationResult, generate_stream


@dataclass(frozen=True)
class Load:
    background: list[tuple[int, ...]]
    tokens: int
    arrivals: list[tuple[int, ...]]
    arrival_tokens: int
    interval: float


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Distinct random prompts (no prefix shared: nothing is cached between them)."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(5, vocab) for _ in range(length)) for _ in range(count)]


async def _stream(
    target: str,
    prompt: tuple[int, ...],
    tokens: int,
    delay: float,
    first: asyncio.Event,
    stop: asyncio.Event | None = None,
) -> dict:
    """One generation; `stop` set ends it early (the stream closed: the engine cancels it)."""
    await asyncio.sleep(delay)
    cfg = GenerateConfig(target=target, prompt=prompt, max_new_tokens=tokens, timeout=600)
    result = GenerationResult()
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            async for _ in generate_stream(channel, cfg, result):
                first.set()
                if stop is not None and stop.is_set():
                    break
    finally:
        first.set()  # a stream that failed does not hold the arrivals back
    return {"ttft": result.ttft_s, "arrivals": result.arrival_s, "ids": result.tokens}


async def _both(targets: list[str], load: Load) -> tuple[list[dict], list[dict], float, float]:
    n, stop = len(targets), asyncio.Event()
    firsts = [asyncio.Event() for _ in load.background]
    background = [
        asyncio.create_task(_stream(targets[i % n], p, load.tokens, 0.0, firsts[i], stop))
        for i, p in enumerate(load.background)
    ]
    await asyncio.gather(*(e.wait() for e in firsts))
    start = time.monotonic()
    calls = [
        _stream(targets[i % n], p, load.arrival_tokens, i * load.interval, asyncio.Event())
        for i, p in enumerate(load.arrivals)
    ]
    arrived = await asyncio.gather(*calls)
    end = time.monotonic()
    stop.set()
    return list(await asyncio.gather(*background)), list(arrived), start, end


def run(targets: list[str], load: Load) -> dict:
    """Every stream's record and the arrivals' window."""
    bg, arrived, start, end = asyncio.run(_both(targets, load))
    return {"background": bg, "arrivals": arrived, "window": (start, end)}


def warm(targets: list[str], batch: list[tuple[int, ...]]) -> None:
    """One short generation per prompt, all at once (compiles, connections)."""
    asyncio.run(_both(targets, Load(batch, 2, [], 0, 0.0)))


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def _ms(values: list[float], name: str) -> dict:
    return {
        f"{name}_ms_p50": 1e3 * pct(values, 0.5),
        f"{name}_ms_p99": 1e3 * pct(values, 0.99),
        f"{name}_ms_mean": 1e3 * statistics.fmean(values) if values else 0.0,
    }


def max_n_share(bg: list[dict], start: float, end: float) -> float:
    """The share of the arrivals' window in which every background stream was still decoding
    (the decode side at max N): until the first background stream's last token. Below 1 the
    ITL figures saw fewer streams for part of the window (a stream reached --tokens)."""
    lasts = [r["arrivals"][-1] for r in bg if r["arrivals"]]
    if end <= start or not lasts:
        return 0.0
    return min(1.0, max(0.0, (min(lasts) - start) / (end - start)))


def summarize(done: dict) -> dict:
    """TTFT of the arrivals and of the background burst, the background's ITL within the
    arrivals' window and its tokens per second there, and a hash of every token."""
    bg, arrived, (start, end) = done["background"], done["arrivals"], done["window"]
    gaps = [
        b - a
        for r in bg
        for a, b in zip(r["arrivals"], r["arrivals"][1:])
        if a >= start and b <= end
    ]
    in_window = sum(start <= t <= end for r in bg for t in r["arrivals"])
    # The background stops where the window ends, a timing: only its first tokens are compared.
    ids = json.dumps([r["ids"][:1] for r in bg] + [r["ids"] for r in arrived]).encode()
    return {
        "streams": len(bg),
        "arrivals": len(arrived),
        "tokens": sum(len(r["ids"]) for r in bg + arrived),
        "window_s": end - start,
        "max_n_share": max_n_share(bg, start, end),
        "itl_gaps": len(gaps),
        "decode_tok_per_s": in_window / (end - start) if end > start else 0.0,
        **_ms([r["ttft"] for r in arrived if r["ttft"] is not None], "ttft"),
        **_ms([r["ttft"] for r in bg if r["ttft"] is not None], "burst_ttft"),
        **_ms(gaps, "itl"),
        # Greedy: every run of the same prompts must give the same tokens (compared in cli):
        # the arrivals' whole generations and the background's first tokens.
        "tokens_sha1": hashlib.sha1(ids).hexdigest(),
    }

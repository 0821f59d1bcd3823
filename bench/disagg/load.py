"""The load of one run: `streams` prompts arriving `interval` seconds apart (new prompts keep
arriving while the earlier ones decode), spread round-robin over the decode side's engines;
per stream the time to first token and the arrival of every token."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import statistics
import time

import grpc

from engine_client.cli.config import GenerateConfig
from engine_client.cli.generate import GenerationResult, generate_stream


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Distinct random prompts (no prefix shared: nothing is cached between them)."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(5, vocab) for _ in range(length)) for _ in range(count)]


async def _stream(target: str, prompt: tuple[int, ...], tokens: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    cfg = GenerateConfig(target=target, prompt=prompt, max_new_tokens=tokens, timeout=600)
    result = GenerationResult()
    async with grpc.aio.insecure_channel(target) as channel:
        async for _ in generate_stream(channel, cfg, result):
            pass
    return {"ttft": result.ttft_s, "arrivals": result.arrival_s, "ids": result.tokens}


async def _all(targets: list[str], batch: list[tuple[int, ...]], tokens: int, interval: float):
    calls = [
        _stream(targets[i % len(targets)], p, tokens, i * interval) for i, p in enumerate(batch)
    ]
    return await asyncio.gather(*calls)


def run(
    targets: list[str], batch: list[tuple[int, ...]], tokens: int, interval: float
) -> tuple[list[dict], float]:
    """Every stream's record and the wall time of the whole load."""
    start = time.monotonic()
    records = asyncio.run(_all(targets, batch, tokens, interval))
    return list(records), time.monotonic() - start


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def summarize(records: list[dict], wall: float) -> dict:
    """TTFT and inter-token latency (ms; gaps between a stream's tokens), tokens per second."""
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]
    gaps = [b - a for r in records for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tokens = sum(len(r["ids"]) for r in records)
    ids = json.dumps([r["ids"] for r in records]).encode()
    return {
        "streams": len(records),
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall if wall else 0.0,
        "ttft_ms_p50": 1e3 * pct(ttft, 0.5),
        "ttft_ms_p99": 1e3 * pct(ttft, 0.99),
        "ttft_ms_mean": 1e3 * statistics.fmean(ttft) if ttft else 0.0,
        "itl_ms_p50": 1e3 * pct(gaps, 0.5),
        "itl_ms_p99": 1e3 * pct(gaps, 0.99),
        "itl_ms_mean": 1e3 * statistics.fmean(gaps) if gaps else 0.0,
        # Greedy: every run of the same prompts must give the same tokens (compared in cli).
        "tokens_sha1": hashlib.sha1(ids).hexdigest(),
    }

"""Stream drivers of bench/gateway/cli.py: N concurrent generations through the engine's gRPC
Generate or the gateway's /v1/completions (stream=true), split over worker processes so the
client is not the bottleneck. Both routes send the same text prompts and record the client
arrival time of every event that carries text (gRPC: a token response with text; HTTP: an SSE
chunk), so their gaps measure the same thing."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ProcessPoolExecutor

import aiohttp
import grpc

from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc

STREAMS_PER_CHANNEL = 32
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


def prompt(i: int, words: int) -> str:
    return " ".join(f"word{(i * 7 + k) % 97}" for k in range(words))


async def _grpc_one(stub, i: int, words: int, tokens: int, timeout: float) -> dict:
    req = pb.GenerateRequest(
        text=prompt(i, words),
        max_new_tokens=tokens,
        sampling=pb.Sampling(temperature=1.0, seed=i),
    )
    t0, arrivals, n = time.monotonic(), [], 0
    async for resp in stub.Generate(req, timeout=timeout):
        if resp.text:
            arrivals.append(time.monotonic() - t0)
        if resp.finished:
            n = resp.usage.generated_tokens
    return {"arrivals": arrivals, "tokens": n}


async def _http_one(
    session: aiohttp.ClientSession, url: str, i: int, words: int, tokens: int
) -> dict:
    body = {
        "prompt": prompt(i, words),
        "max_tokens": tokens,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0, arrivals, n = time.monotonic(), [], 0
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                n = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                arrivals.append(time.monotonic() - t0)
    return {"arrivals": arrivals, "tokens": n}


async def _run(route: str, where: str, ids: range, words: int, tokens: int) -> list[dict]:
    timeout = 3600.0
    if route == "grpc":
        channels = [
            grpc.aio.insecure_channel(where, options=CHANNEL_OPTIONS)
            for _ in range(-(-len(ids) // STREAMS_PER_CHANNEL))
        ]
        try:
            stubs = [pb_grpc.DecodeServiceStub(c) for c in channels]
            calls = [
                _grpc_one(stubs[k // STREAMS_PER_CHANNEL], i, words, tokens, timeout)
                for k, i in enumerate(ids)
            ]
            return list(await asyncio.gather(*calls))
        finally:
            for c in channels:
                await c.close()
    limits = aiohttp.TCPConnector(limit=0)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=limits, timeout=client_timeout) as session:
        return list(
            await asyncio.gather(*(_http_one(session, where, i, words, tokens) for i in ids))
        )


def _worker(route: str, where: str, first: int, n: int, words: int, tokens: int) -> list[dict]:
    return asyncio.run(_run(route, where, range(first, first + n), words, tokens))


def run_streams(
    route: str, where: str, streams: int, words: int, tokens: int, workers: int
) -> tuple[list[dict], float]:
    """All streams of one phase at once; returns their records and the wall time."""
    workers = max(1, min(workers, streams))
    if workers == 1:  # in this process (the smoke run, tests)
        t0 = time.monotonic()
        return _worker(route, where, 0, streams, words, tokens), time.monotonic() - t0
    share = [streams // workers + (k < streams % workers) for k in range(workers)]
    firsts = [sum(share[:k]) for k in range(workers)]
    with ProcessPoolExecutor(workers) as pool:
        pool.submit(int).result()  # workers up before the clock starts
        list(pool.map(int, range(workers)))
        t0 = time.monotonic()
        futures = [
            pool.submit(_worker, route, where, f, n, words, tokens)
            for f, n in zip(firsts, share)
            if n
        ]
        records = [r for fut in futures for r in fut.result()]
        return records, time.monotonic() - t0

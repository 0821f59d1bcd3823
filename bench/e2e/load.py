"""Load side of bench.e2e: N concurrent decode.v1 Generate streams, spread over worker
processes, so the client is never what limits a few hundred streams (what is sampled beside
them: bench.e2e.sampler).

A stream's record (plain dict, picklable): submitted time, arrival time of every token (the
system-wide monotonic clock, comparable across processes), the final stats and any error.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import grpc

from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc

STREAMS_PER_CHANNEL = 32
# Own subchannels per channel: streams spread over several connections.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


class _Count:
    """Tokens received so far (a shared mp.Value in worker processes)."""

    value = 0


_counter: Any = _Count()


def _init_worker(counter: Any) -> None:
    global _counter
    _counter = counter


def _bump() -> None:
    if isinstance(_counter, _Count):
        _counter.value += 1
        return
    with _counter.get_lock():
        _counter.value += 1


async def _stream(stub: pb_grpc.DecodeServiceStub, req: pb.GenerateRequest, timeout: float) -> dict:
    rec: dict = {
        "submitted": time.monotonic(),
        "arrivals": [],
        "hits": 0,
        "misses": 0,
        "bytes_moved": 0,
        "finish": "",
        "error": "",
        "tokens": [],
    }
    call = stub.Generate(req, timeout=timeout, wait_for_ready=True)
    try:
        async for resp in call:
            if resp.has_token:
                rec["arrivals"].append(time.monotonic())
                rec["tokens"].append(resp.token_id)
                _bump()
            if resp.finished:
                rec["finish"] = pb.FinishReason.Name(resp.finish_reason)
                rec["hits"], rec["misses"] = resp.stats.hits, resp.stats.misses
                rec["bytes_moved"] = resp.stats.bytes_moved
                rec["error"] = resp.error_message
    except grpc.aio.AioRpcError as e:
        rec["error"] = f"{e.code().name}: {e.details()}"
    return rec


def prompt_ids(stream: int, prompt_len: int, vocab: int) -> list[int]:
    """The prompt of stream `stream` of every phase (bench.mtp finds recorded tokens by it)."""
    rng = random.Random(stream)
    return [rng.randrange(1, vocab) for _ in range(prompt_len)]


async def run_streams_async(
    target: str, first: int, n: int, prompt_len: int, vocab: int, new_tokens: int, timeout: float
) -> list[dict]:
    channels = [
        grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        for _ in range(-(-n // STREAMS_PER_CHANNEL))
    ]
    try:
        calls = []
        for i in range(first, first + n):
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt_ids(i, prompt_len, vocab)),
                max_new_tokens=new_tokens,
            )
            stub = pb_grpc.DecodeServiceStub(channels[(i - first) // STREAMS_PER_CHANNEL])
            calls.append(_stream(stub, req, timeout))
        return list(await asyncio.gather(*calls))
    finally:
        for ch in channels:
            await ch.close()


def run_streams(*args: Any) -> list[dict]:
    """Worker-process entry point."""
    return asyncio.run(run_streams_async(*args))


def _noop() -> None:
    return None


class LoadGen:
    """Streams from `procs` worker processes (1: in this process)."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self.pool: ProcessPoolExecutor | None = None
        if procs > 1:
            ctx = mp.get_context("spawn")  # never fork a process that holds grpc state
            self.counter: Any = ctx.Value("q", 0)
            self.pool = ProcessPoolExecutor(
                procs, mp_context=ctx, initializer=_init_worker, initargs=(self.counter,)
            )
            for f in [self.pool.submit(_noop) for _ in range(procs)]:
                f.result()  # start and import now, not inside a timed phase
        else:
            self.counter = _counter

    @property
    def received(self) -> int:
        return int(self.counter.value)

    async def run(
        self, target: str, n: int, prompt_len: int, vocab: int, new_tokens: int, timeout: float
    ) -> list[dict]:
        self.counter.value = 0
        if self.pool is None:
            return await run_streams_async(target, 0, n, prompt_len, vocab, new_tokens, timeout)
        loop = asyncio.get_running_loop()
        shares = [n // self.procs + (i < n % self.procs) for i in range(self.procs)]
        starts = [sum(shares[:i]) for i in range(self.procs)]
        futs = [
            loop.run_in_executor(
                self.pool, run_streams, target, s, k, prompt_len, vocab, new_tokens, timeout
            )
            for s, k in zip(starts, shares)
            if k
        ]
        return [rec for part in await asyncio.gather(*futs) for rec in part]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

"""`python -m engine_client demo`: the whole stack on one machine, then gone without a trace.

Starts a KV service (service modes) and an engine as child processes on sockets in a temporary
directory, waits for their health, streams a few concurrent generations with their text shown
as it streams (one line per generation: cli/transcript.py), then a chat, prints short
per-request and overall stats (TTFT, ITL, tokens/s, hit rate, bytes moved), and stops both
(SIGTERM), checking that no child and no /dev/shm segment is left behind.

SIGTERM, SIGHUP and SIGINT (as `kill`, `timeout`, a closed terminal or Ctrl-C send them) stop
the demo the same way: the children are stopped, their /dev/shm files and the temporary
directory removed, and the demo exits with 128 + the signal number. If the demo itself is
killed outright, its children get SIGTERM from the kernel (`procs`: parent-death signal).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import grpc

from contract import errors, flags
from engine_client.cli.config import DemoConfig, GenerateConfig
from engine_client.cli.generate import GenerationResult, generate_stream
from engine_client.cli.stop_signals import StopSignals
from engine_client.cli.transcript import Transcript, visible
from engine_client.serve.procs import (
    ChildFailed,
    ManagedProcess,
    engine_process,
    segment_files,
    service_process,
)
from engine_client.serve.settings.local_layout import LocalLayout

SHM_DIR = "/dev/shm"
# Tiny preset (2 layers, top-k 16). A request of 24 + 24 tokens exceeds the 32 hot slots, so
# decoding goes through the host tier: hits, misses and bytes moved are all exercised.
LOCAL = LocalLayout(
    max_requests=8, hot_slots=32, window=8, page_size=16, num_pages=64, max_context=256
)
LAYOUT = LOCAL.layout(num_layers=2, topk=16)


async def _one(
    channel: grpc.aio.Channel,
    i: int,
    cfg: DemoConfig,
    transcript: Transcript,
    result: GenerationResult,
) -> None:
    rng = random.Random(i)
    gen = GenerateConfig(
        target="",
        prompt=tuple(rng.randrange(1, 256) for _ in range(cfg.prompt_len)),
        max_new_tokens=cfg.max_new_tokens,
        temperature=0.8 if i % 2 else 0.0,
        seed=i,
        timeout=max(60.0, cfg.startup_timeout),
    )
    try:
        async for _ in generate_stream(
            channel, gen, result, on_text=lambda piece: transcript.add(i, piece)
        ):
            pass
    except errors.KVError as e:
        result.error = str(e)
    transcript.end(i)


async def _stream_all(target: str, cfg: DemoConfig) -> tuple[list[GenerationResult], float]:
    transcript = Transcript(cfg.requests, cfg.progress)
    results = [GenerationResult() for _ in range(cfg.requests)]
    started = time.monotonic()
    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.gather(*(_one(channel, i, cfg, transcript, r) for i, r in enumerate(results)))
    transcript.close()
    return results, time.monotonic() - started


CHAT = "Hello! What is a sparse attention KV cache?"


async def _stream_text(target: str, cfg: DemoConfig) -> GenerationResult:
    """One chat, its answer printed as it streams (the weights are random: gibberish text,
    real path: chat format, tokenizer, incremental detokenization)."""
    gen = GenerateConfig(
        target="", chat=CHAT, max_new_tokens=cfg.max_new_tokens, temperature=0.7, seed=1
    )
    result = GenerationResult()
    print(f"chat> {CHAT}\nreply (random weights, so gibberish)> ", end="", flush=True)
    async with grpc.aio.insecure_channel(target) as channel:

        def show(piece: str) -> None:
            print(visible(piece), end="", flush=True)

        async for _ in generate_stream(channel, gen, result, on_text=show):
            pass
    print(f"\n  {_brief(result)}", flush=True)
    return result


def _brief(r: GenerationResult) -> str:
    """A generation's stats in one short line (its text was shown as it streamed)."""
    parts = [f"{len(r.tokens)} tokens ({len(r.text)} chars), {r.finish_reason}"]
    if r.ttft_s is not None:
        parts.append(f"TTFT {r.ttft_s * 1e3:.1f} ms")
    if r.itl_s:
        parts.append(f"ITL {statistics.fmean(r.itl_s) * 1e3:.1f} ms")
    rate = r.hit_rate
    parts.append(f"hit rate {rate:.1%}" if rate is not None else "hit rate n/a")
    return ", ".join(parts + ([f"error: {r.error}"] if r.error else []))


def _service_stats(svc: ManagedProcess) -> str:
    from proto.kvcache.v1 import kvcache_pb2 as kpb
    from proto.kvcache.v1 import kvcache_pb2_grpc as kpb_grpc

    with grpc.insecure_channel(svc.target) as channel:
        s = kpb_grpc.KVCacheServiceStub(channel).GetStats(kpb.GetStatsRequest(), timeout=5)
    total = s.hits + s.misses
    rate = f"{s.hits / total:.1%}" if total else "n/a"
    return (
        f"service: hit rate {rate} ({s.hits} hits, {s.misses} misses), {s.bytes_moved} B "
        f"moved host->device, {s.admitted_total} admitted, {s.rejected_total} refused for "
        f"capacity, pages in use {s.host_pages.used}/{s.host_pages.total}"
    )


def _plan(cfg: DemoConfig) -> str:
    labels = [Transcript.label(i) for i in range(cfg.requests)]
    return (
        f"streaming {cfg.requests} generations of {cfg.max_new_tokens} tokens from random "
        f"{cfg.prompt_len}-token prompts ({', '.join(labels[::2])} greedy"
        + (f"; {', '.join(labels[1::2])} sampled)" if cfg.requests > 1 else ")")
        + "\n(random weights: gibberish text; bytes that form no UTF-8 character show as \ufffd)"
    )


def _report(results: list[GenerationResult], seconds: float) -> bool:
    ok = True
    for i, r in enumerate(results):
        print(f"  {Transcript.label(i)} {_brief(r)}")
        ok &= not r.error and r.finish_reason in ("LENGTH", "STOP")
    tokens = sum(len(r.tokens) for r in results)
    hits, misses = sum(r.hits for r in results), sum(r.misses for r in results)
    rate = f"{hits / (hits + misses):.1%}" if hits + misses else "n/a"
    print(
        f"engine: {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s), hit rate "
        f"{rate}, {sum(r.bytes_moved for r in results)} B moved host->device"
    )
    return ok


def _start(
    cfg: DemoConfig,
    workdir: str,
    instance: str,
    children: list[ManagedProcess],
    abort: Callable[[], bool],
) -> tuple[ManagedProcess | None, ManagedProcess]:
    """Start the children; each one goes to the front of `children` (stop order) once started.
    ChildFailed as soon as `abort()` says so."""
    svc = None
    extra = ["--max-batch", str(min(cfg.requests, LOCAL.max_requests))]
    if cfg.kv_mode.startswith("service"):
        svc = service_process(
            workdir,
            instance,
            flags.to_flags(LAYOUT),
            device=cfg.device,
            shm_dir=SHM_DIR,
            extra=["--lease-seconds", "5", "--drain-timeout", "2"],
        ).start()
        children.insert(0, svc)
        print(f"kv_service pid {svc.pid} on {svc.target}", flush=True)
        svc.wait_serving(cfg.startup_timeout, abort)
        service_uds = svc.target.removeprefix("unix:")
        eng = engine_process(workdir, cfg.kv_mode, service_uds=service_uds, extra=extra)
    else:
        eng = engine_process(
            workdir, cfg.kv_mode, extra=extra + ["--device", cfg.device] + flags.to_flags(LOCAL)
        )
    if abort():
        raise ChildFailed("start-up abandoned")
    eng.start()
    children.insert(0, eng)
    print(f"engine pid {eng.pid} on {eng.target} ({cfg.kv_mode})", flush=True)
    eng.wait_serving(cfg.startup_timeout, abort)
    return svc, eng


def _shutdown(children: list[ManagedProcess], instance: str) -> bool:
    """Stop children in order (engine first); True if all exited cleanly and left no files."""
    clean = True
    for child in children:
        code = child.stop()
        if code != 0:
            print(f"{child.name} exited with {code}:\n{child.log()}", file=sys.stderr)
            clean = False
    left = segment_files(SHM_DIR, instance)
    for name in left:
        os.unlink(os.path.join(SHM_DIR, name))
    if left:
        print(f"removed {len(left)} leftover segment files: {left}", file=sys.stderr)
    return clean and not left


def run_demo(cfg: DemoConfig) -> int:
    stop = StopSignals()
    workdir = tempfile.mkdtemp(prefix="hisparse-demo-", dir="/tmp")
    instance = f"demo{os.getpid()}"
    children: list[ManagedProcess] = []
    ok = False
    try:
        svc, eng = _start(cfg, workdir, instance, children, stop.requested)
        print(_plan(cfg), flush=True)
        streamed = asyncio.run(stop.run(_stream_all(eng.target, cfg)))
        if streamed is not None:
            ok = _report(*streamed)
            chat = asyncio.run(stop.run(_stream_text(eng.target, cfg)))
            ok = ok and chat is not None and chat.finish_reason in ("LENGTH", "STOP")
            if svc is not None:
                print(_service_stats(svc))
    except Exception as e:  # noqa: BLE001 - the demo reports any failure and cleans up
        if not stop.requested():
            print(f"demo failed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        if stop.requested():
            print(
                f"\ndemo stopped by {stop.name}: stopping its processes",
                file=sys.stderr,
                flush=True,
            )
        ok = _shutdown(children, instance) and ok
        shutil.rmtree(workdir, ignore_errors=True)
        stop.restore()
    if stop.signum is not None:
        print("demo stopped; processes and files cleaned up", flush=True)
        return 128 + stop.signum
    print("demo finished cleanly" if ok else "demo FAILED", flush=True)
    return 0 if ok else 1

"""Prefix sharing benchmark (issue 20): the kv service and the engines as separate processes.

    python -m bench.prefix              # GPU: preset bench, 32K context, 24K shared prefix
    python -m bench.prefix --smoke      # CPU: tiny preset and sizes, the whole harness

Parts (--parts, all by default), same run, ratios in the table:
- capacity: every request holds a `context`-token context whose first `shared` tokens are common
  (synthetic KV: engine --synthetic-context/--synthetic-shared) and a distinct real prompt.
  Service mode without and with sharing, and the all-on-GPU baseline, each sized to the same
  GPU KV budget (bench/prefix/plan.py): max concurrent requests, and decode tok/s with every
  stream running (bench/e2e/stats.py's window).
- ttft: a real prompt of `shared` tokens + a distinct suffix, prefilled cold, then again with
  another suffix (its prefix cached): TTFT cached / cold, service and baseline.
- multiturn: `conversations` conversations of `turns` turns at once (each turn: the conversation
  so far + a new message; `answer` tokens back), prefix caching on vs off: prefilled tokens and
  TTFT per turn.
Progress on stderr; JSON to bench/results/prefix[-smoke]-<date>.json; a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import grpc

from bench.e2e.load import LoadGen
from bench.e2e.stats import analyze
from bench.prefix import plan
from bench.prefix.children import Procs
from engine_client.cli.config import GenerateConfig
from engine_client.cli.generate import GenerationResult, generate_stream
from engine_client.serve.procs import (
    REPO_ROOT,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset and sizes")
    ap.add_argument("--parts", default="capacity,ttft,multiturn")
    ap.add_argument("--out", default="", help="JSON path [bench/results/prefix-<date>.json]")
    ap.add_argument("--gpu-kv-gib", type=float, default=None, help="GPU KV budget [6]")
    ap.add_argument("--context", type=int, default=None, help="[32768; smoke 128]")
    ap.add_argument("--shared", type=int, default=None, help="[24576; smoke 64]")
    ap.add_argument("--conversations", type=int, default=None, help="[64; smoke 3]")
    ap.add_argument("--turns", type=int, default=None, help="[8; smoke 3]")
    ap.add_argument("--client-procs", type=int, default=None, help="[4; smoke 1]")
    return ap.parse_args(argv)


def sizes_from_args(a: argparse.Namespace, device: str) -> plan.Sizes:
    big = not a.smoke
    pick = lambda v, small, large: v if v is not None else (large if big else small)  # noqa: E731
    return plan.Sizes(
        preset="bench" if big else "tiny",
        device=device,
        gpu_kv_bytes=int(pick(a.gpu_kv_gib, 1 / 1024, 6.0) * (1 << 30)),
        context=pick(a.context, 128, 32768),
        shared=pick(a.shared, 64, 24576),
        prompt_len=16 if big else 8,
        steady_steps=128 if big else 16,
        hot_slots=4096 if big else 32,
        window=128 if big else 8,
        page_size=64 if big else 8,
        prefill_chunk=2048 if big else 8,
        ttft_suffix=256 if big else 8,
        ttft_repeats=3 if big else 2,
        conversations=pick(a.conversations, 3, 64),
        turns=pick(a.turns, 3, 8),
        message=256 if big else 8,
        answer=64 if big else 4,
    )


async def stream(target: str, prompt: list[int], new: int) -> GenerationResult:
    cfg = GenerateConfig(target=target, prompt=tuple(prompt), max_new_tokens=new, timeout=900)
    result = GenerationResult()
    async with grpc.aio.insecure_channel(target) as channel:
        async for _ in generate_stream(channel, cfg, result):
            pass
    return result


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


async def capacity(p: Procs, s: plan.Sizes, load: LoadGen, vocab: int) -> list[dict]:
    runs = plan.capacity_runs(s)
    synthetic = ["--synthetic-context", str(plan.synthetic_tokens(s, runs))]
    synthetic += ["--synthetic-shared", str(s.shared)]
    out = []
    for r in runs:
        log(f"capacity: {r.label}, {r.slots} requests")
        lay = plan.layout(s, r.slots, r.pages, s.context)
        eng = p.start(r.mode, lay, r.sharing, tuple(synthetic))
        await load.run(eng.target, 1, s.prompt_len, vocab, 2, 900)  # warm-up: fills the prefix
        recs = await load.run(eng.target, r.slots, s.prompt_len, vocab, r.new_tokens, 900)
        res = {**asdict(r), **analyze(recs, [], r.slots, None), "kv": p.stats()}
        res["engine_exit"] = p.stop_engine()
        out.append(res)
    return out


async def ttft(p: Procs, s: plan.Sizes, vocab: int) -> list[dict]:
    """Per mode: pairs (cold, cached) of prompts sharing a fresh random prefix."""
    ctx = s.shared + s.ttft_suffix + 4
    out = []
    for mode in ("service", "baseline"):
        log(f"ttft: {mode}")
        lay = plan.layout(s, 2, 4 * -(-ctx // s.page_size), ctx)
        eng = p.start(mode, lay, True)
        rng, pairs = random.Random(1), []
        for _ in range(s.ttft_repeats):
            prefix = [rng.randrange(1, vocab) for _ in range(s.shared)]
            runs = []
            for _ in range(2):
                suffix = [rng.randrange(1, vocab) for _ in range(s.ttft_suffix)]
                runs.append(await stream(eng.target, prefix + suffix, 4))
            pairs.append([(r.ttft_s, r.cached_tokens) for r in runs])
        cold = statistics.median(c[0][0] for c in pairs)
        hot = statistics.median(c[1][0] for c in pairs)
        out.append(
            {"mode": mode, "pairs": pairs, "cold_s": cold, "cached_s": hot, "ratio": hot / cold}
        )
        p.stop_engine()
    return out


async def conversation(target: str, s: plan.Sizes, c: int, vocab: int) -> list[dict]:
    rng, history, turns = random.Random(1000 + c), [], []
    for _ in range(s.turns):
        prompt = history + [rng.randrange(1, vocab) for _ in range(s.message)]
        r = await stream(target, prompt, s.answer)
        turns.append({"prompt": len(prompt), "cached": r.cached_tokens, "ttft_s": r.ttft_s})
        history = prompt + r.tokens
    return turns


async def multiturn(p: Procs, s: plan.Sizes, vocab: int) -> list[dict]:
    ctx = s.turns * (s.message + s.answer) + s.page_size
    ppr = -(-ctx // s.page_size)
    out = []
    for sharing in (False, True):
        log(f"multiturn: {s.conversations} x {s.turns}, reuse {sharing}")
        lay = plan.layout(s, s.conversations, 2 * s.conversations * ppr, ctx)
        eng = p.start("service", lay, sharing)
        t0 = time.monotonic()
        convs = await asyncio.gather(
            *(conversation(eng.target, s, c, vocab) for c in range(s.conversations))
        )
        per_turn = [
            {
                "prefilled_mean": statistics.fmean(c[t]["prompt"] - c[t]["cached"] for c in convs),
                "ttft_p50_s": statistics.median(c[t]["ttft_s"] for c in convs),
            }
            for t in range(s.turns)
        ]
        out.append(
            {"reuse": sharing, "wall_s": time.monotonic() - t0, "turns": per_turn, "kv": p.stats()}
        )
        p.stop_engine()
    return out


def print_table(payload: dict) -> None:
    print(f"\nprefix sharing, {payload['device']}, {payload['date']}")
    cap = {(r["mode"], r["sharing"]): r for r in payload.get("capacity", [])}
    for (mode, sharing), r in cap.items():
        tok = f"{r['tok_s']:.0f}" if r.get("tok_s") else "n/a"
        print(f"  capacity {mode:8} sharing={sharing!s:5} N={r['slots']:5}  tok/s {tok}")
    a, b = cap.get(("service", False)), cap.get(("service", True))
    if a and b:
        rate = f"{b['tok_s'] / a['tok_s']:.2f}x" if a.get("tok_s") and b.get("tok_s") else "n/a"
        print(
            f"  sharing / not (same run): max requests {b['slots'] / a['slots']:.2f}x, tok/s {rate}"
        )
    for t in payload.get("ttft", []):
        print(
            f"  TTFT {t['mode']:8} cold {t['cold_s']:.3f}s cached {t['cached_s']:.3f}s"
            f" = {t['ratio']:.3f}x"
        )
    for m in payload.get("multiturn", []):
        cells = " ".join(f"{t['prefilled_mean']:.0f}/{t['ttft_p50_s']:.3f}s" for t in m["turns"])
        print(f"  multiturn reuse={m['reuse']!s:5} prefilled/TTFT p50 per turn: {cells}")


async def run_parts(args, s: plan.Sizes, p: Procs) -> dict:
    from engine_client.model.preset import preset

    vocab, parts, out = preset(s.preset).vocab_size, args.parts.split(","), {}
    load = LoadGen(args.client_procs or (1 if args.smoke else 4))
    try:
        if "capacity" in parts:
            out["capacity"] = await capacity(p, s, load, vocab)
        if "ttft" in parts:
            out["ttft"] = await ttft(p, s, vocab)
        if "multiturn" in parts:
            out["multiturn"] = await multiturn(p, s, vocab)
    finally:
        load.close()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    s, t0 = sizes_from_args(args, device), time.monotonic()
    p = Procs(s, 120 if args.smoke else 600)
    try:
        results = asyncio.run(run_parts(args, s, p))
    finally:
        left = p.close()
    name = f"prefix{'-smoke' if args.smoke else ''}-{time.strftime('%Y-%m-%d')}.json"
    out = Path(args.out) if args.out else REPO_ROOT / "bench" / "results" / name
    payload = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "sizes": asdict(s),
        **results,
        "leftover_segments": left,
        "wall_s": time.monotonic() - t0,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print_table(payload)
    failed = [r for r in payload.get("capacity", []) if r["engine_exit"] or r["errors"]]
    return 1 if failed or left else 0


if __name__ == "__main__":
    raise SystemExit(main())

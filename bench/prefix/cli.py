"""Prefix sharing benchmark (issue 20): the kv service and the engines as separate processes.

    python -m bench.prefix              # GPU: preset bench, 32K context, 24K shared prefix
    python -m bench.prefix --smoke      # CPU: tiny preset and sizes, the whole harness

Parts (--parts, all by default), same run, ratios in the table (bench/prefix/runs.py):
- capacity: every request holds a `context`-token context whose first `shared` tokens are common
  (synthetic KV: engine --synthetic-context/--synthetic-shared) and a distinct real prompt.
  Service mode without and with sharing, with sharing and shared hot rows (the service's
  --shared-slots: --shared-slots, --private-hot-slots), and the all-on-GPU baseline, each sized
  to the same GPU KV budget (bench/prefix/plan.py, contract/capacity.py): max concurrent
  requests, and decode tok/s with every stream running (bench/e2e/stats.py's window); per top-k
  source (--sources, as bench.e2e); --capacity-runs picks the runs.
- ttft: a real prompt of `shared` tokens + a distinct suffix, prefilled cold, then again with
  another suffix (its prefix cached): TTFT cached / cold, service and baseline; and the same with
  a prefix short enough for a resident request. Each with the engine's queue time, which for a
  lone request is its admission (a cached one's includes copying the cached rows).
- multiturn: `conversations` conversations of `turns` turns at once (each turn: the conversation
  so far + a new message; `answer` tokens back), prefix caching on vs off: prefilled tokens and
  TTFT per turn, split into the engine's queue wait, the wait behind other prefills, the rest.
Progress on stderr; JSON to bench/results/prefix[-smoke]-<date>.json, rewritten after every
run ("complete": false until the last, so a run cut by a time limit keeps what it measured); a
table last.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench.e2e.load import LoadGen
from bench.prefix import plan, runs
from bench.prefix.children import Procs
from bench.shared.result_file import write_json
from engine_client.serve.procs import REPO_ROOT


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
    ap.add_argument("--sources", default="trace,indexer", help="capacity's top-k sources")
    ap.add_argument("--row-format", default="bf16", help="KV row format: bf16 or fp8 [bf16]")
    ap.add_argument(
        "--admission-limit", default="auto", help="the engines' --admission-limit [auto]"
    )
    ap.add_argument(
        "--reuse-pages",
        type=int,
        choices=(0, 1),
        default=1,
        help="the sharing engines' --prefix-reuse-pages: 1 reuse to the page (a next turn "
        "prefills only its new pages), 0 to the prefill chunk [1, the engine's default]",
    )
    _capacity_args(ap)
    return ap.parse_args(argv)


def _capacity_args(ap: argparse.ArgumentParser) -> None:
    """The capacity part's runs and its shared hot rows."""
    ap.add_argument(
        "--shared-slots",
        default="auto",
        help="capacity: also a run with shared hot rows, its region of S slots per layer "
        "(given to the service: its layout's --shared-slots); auto: the shared prefix's rows "
        "in whole private buffers; 0: no such run [auto]",
    )
    ap.add_argument(
        "--capacity-runs",
        default=",".join(plan.CAPACITY_RUNS),
        help="capacity: which runs, of " + ", ".join(plan.CAPACITY_RUNS) + " [all]",
    )
    ap.add_argument(
        "--private-hot-slots",
        type=int,
        default=None,
        help="each request's private hot buffer in that run [W + k, the least a step needs "
        "without host reads]; below W + k the layout turns on host_reads (issue 40): the "
        "misses past the victims are read from the host tier",
    )


def region_sizes(a: argparse.Namespace, shared: int, window: int, topk: int) -> tuple[int, int]:
    """(S, private B) of the capacity part's run with shared hot rows; S = 0: no such run."""
    private = a.private_hot_slots or window + topk
    if a.shared_slots == "auto":
        return -(-shared // private) * private, private
    if not a.shared_slots.isdigit():
        raise SystemExit(f"--shared-slots must be auto or a number, got {a.shared_slots!r}")
    return int(a.shared_slots), private


def sizes_from_args(a: argparse.Namespace, device: str) -> plan.Sizes:
    from engine_client.model.preset import preset

    big = not a.smoke
    pick = lambda v, small, large: v if v is not None else (large if big else small)  # noqa: E731
    region, private = region_sizes(
        a, pick(a.shared, 64, 24576), 128 if big else 8, preset("bench" if big else "tiny").topk
    )
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
        sources=tuple(a.sources.split(",")),
        row_format=a.row_format,
        admission_limit=a.admission_limit,
        reuse_pages=bool(a.reuse_pages),
        shared_slots=region,
        private_hot_slots=private,
        capacity_runs=tuple(a.capacity_runs.split(",")),
    )


def print_table(payload: dict) -> None:
    print(f"\nprefix sharing, {payload['device']}, {payload['date']}")
    by_source: dict[str, dict] = {}
    for r in payload.get("capacity", []):
        key = r["mode"], r["sharing"], r.get("shared_slots", 0)
        by_source.setdefault(r.get("source", "indexer"), {})[key] = r
    for source, cap in by_source.items():
        for (mode, sharing, region), r in cap.items():
            tok = f"{r['tok_s']:.0f}" if r.get("tok_s") else "n/a"
            print(
                f"  capacity {source:7} {mode:8} sharing={sharing!s:5} S={region:<6} "
                f"N={r['slots']:5}  tok/s {tok}"
            )
        a = cap.get(("service", False, 0))
        for (mode, sharing, region), b in cap.items():
            if a and mode == "service" and sharing:
                ok = a.get("tok_s") and b.get("tok_s")
                rate = f"{b['tok_s'] / a['tok_s']:.2f}x" if ok else "n/a"
                print(
                    f"  {source} sharing{' + shared slots' if region else ''} / not (same run): "
                    f"max requests {b['slots'] / a['slots']:.2f}x, tok/s {rate}"
                )
    for t in payload.get("ttft", []):
        print(
            f"  TTFT {t['mode']:8} {t['case']:9} cold {t['cold_s']:.3f}s cached "
            f"{t['cached_s']:.3f}s = {t['ratio']:.3f}x; admission (queued) cold "
            f"{t['cold_queued_s'] * 1e3:.1f} ms, cached {t['cached_queued_s'] * 1e3:.1f} ms"
        )
    for m in payload.get("multiturn", []):
        print(
            f"  multiturn reuse={m['reuse']!s:5} per turn: prefilled, TTFT p50 = queued + "
            "prefill wait + rest"
        )
        for i, t in enumerate(m["turns"]):
            print(
                f"    turn {i + 1}: {t['prefilled_mean']:6.0f}  {t['ttft_p50_s']:.3f}s = "
                f"{t['queued_p50_s']:.3f} + {t['prefill_wait_p50_s']:.3f} + {t['rest_p50_s']:.3f}"
            )


async def run_parts(args, s: plan.Sizes, p: Procs, save: Callable[[dict], None]) -> dict:
    """The parts asked for; `save(results)` after every run a part finishes."""
    from engine_client.model.preset import preset

    vocab, parts, out = preset(s.preset).vocab_size, args.parts.split(","), {}
    load = LoadGen(args.client_procs or (1 if args.smoke else 4))

    def rows(name: str) -> runs.Rows:
        out[name] = runs.Rows(lambda: save(out))
        return out[name]

    try:
        if "capacity" in parts:
            await runs.capacity(p, s, load, vocab, rows("capacity"))
        if "ttft" in parts:
            await runs.ttft(p, s, vocab, rows("ttft"))
        if "multiturn" in parts:
            await runs.multiturn(p, s, vocab, rows("multiturn"))
    finally:
        load.close()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    s, t0 = sizes_from_args(args, device), time.monotonic()
    name = f"prefix{'-smoke' if args.smoke else ''}-{time.strftime('%Y-%m-%d')}.json"
    out = Path(args.out) if args.out else REPO_ROOT / "bench" / "results" / name
    head = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "sizes": asdict(s),
    }

    def save(results: dict) -> None:  # "complete": false until every part ran (a cut run's JSON)
        write_json({**head, **results, "complete": False}, out)

    p = Procs(s, 120 if args.smoke else 600)
    try:
        results = asyncio.run(run_parts(args, s, p, save))
    finally:
        left = p.close()
    payload = {**head, **results, "complete": True}
    payload.update(leftover_segments=left, wall_s=time.monotonic() - t0)
    write_json(payload, out)
    print_table(payload)
    failed = [r for r in payload.get("capacity", []) if r["engine_exit"] or r["errors"]]
    return 1 if failed or left else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Speculative decoding (MTP) benchmark (issue 22): tokens/s with --speculative mtp vs without,
HiSparse (service mode) and the all-on-GPU baseline in the same run, at ~100% acceptance from
the BENCHMARK-ONLY replay draft source (bench/mtp/draft_replay.py: the drafts are the target's own
tokens recorded by the run without speculation, so they measure the verify path at full
acceptance, not the MTP layer's quality; the MTP layer still runs in every step).

    python -m bench.mtp                      # GPU: 32K and 128K, preset bench, fp8 rows, D = 1
    python -m bench.mtp --draft-tokens 2 --contexts 32768
    python -m bench.mtp --smoke              # CPU: tiny preset, 256 context, the whole harness

Per context and mode: the run without speculation first (phases batch1 and max, N = the mode's
max concurrency in the GPU KV budget, sized with the MTP layer's KV so both runs use the same
N; max-phase streams generate (N + steady steps) (D + 1) tokens, so the speculative run still
has a steady window of steady steps at full concurrency); its greedy tokens become the
recording; then the speculative run on the same prompts. Both
read top-k from the replayed trace (bench/shared/trace.py) and use B = k (D + 1) + W hot slots (the
verify rows' union must fit). Reported per context and mode: tok/s without / with and the
ratio, batch-1 mean ITL without / with (with MTP tokens arrive in bursts, so the mean gap, not
the p50), the measured acceptance (replay at GPU rounding: near 100%, not exactly), drafts per
step, and swap misses per step as copied (the rows share one plan) vs summed over the rows.
JSON to bench/results/mtp-<date>.json, a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.e2e import plan
from bench.e2e.children import Children, Progress
from bench.e2e.cli import GIB
from bench.e2e.load import LoadGen, prompt_ids
from bench.e2e.runs import measure_ceilings, run_one
from bench.mtp.draft_replay import write_recording
from bench.mtp.report import print_table, summary, window_tok_s
from engine_client.loop.speculative import reserve_extra
from engine_client.loop.synthetic import SyntheticContext, prompt_serial
from engine_client.serve.procs import REPO_ROOT

REPLAY = "bench.mtp.draft_replay:replay_source"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset and sizes")
    ap.add_argument("--out", default="", help="JSON path [bench/results/mtp-<date>.json]")
    ap.add_argument("--contexts", default="", help="comma-separated [32768,131072; smoke 256]")
    ap.add_argument("--draft-tokens", type=int, default=1, help="D, 1..3")
    ap.add_argument("--modes", default="baseline,service")
    ap.add_argument("--row-format", default="", help="KV rows [fp8; smoke bf16]")
    ap.add_argument("--gpu-kv-gib", type=float, default=None, help="GPU KV budget [6; smoke 2 MiB]")
    ap.add_argument("--steady-steps", type=int, default=None, help="[128; smoke 8]")
    ap.add_argument("--budget-s", type=float, default=None, help="skip runs past this [540]")
    ap.add_argument(
        "--plain-overlap",
        type=int,
        default=1,
        help="1: the plain runs overlap steps (the engine as it serves); 0: they wait for every "
        "step, as speculative steps do, to separate the overlap's share of the difference",
    )
    return ap.parse_args(argv)


def sizes_of(args: argparse.Namespace, device: str) -> plan.Sizes:
    smoke, d = args.smoke, args.draft_tokens
    window, preset = (8, "tiny") if smoke else (128, "bench")
    base = plan.Sizes(
        preset=preset,
        contexts=tuple(
            int(c) for c in (args.contexts or ("256" if smoke else "32768,131072")).split(",")
        ),
        gpu_kv_bytes=int((args.gpu_kv_gib or (2 / 1024 if smoke else 6.0)) * GIB),
        hot_slots=0,
        window=window,
        page_size=16 if smoke else 64,
        prompt_len=8 if smoke else 16,
        steady_steps=args.steady_steps or (8 if smoke else 128),
        batch1_tokens=8 if smoke else 64,
        device=device,
        sweep_requests=0,
        sweep_factors=(),
        row_format=args.row_format or ("bf16" if smoke else "fp8"),
        mtp_layers=1,
        # A request's tokens must not depend on its slot: the replay finds them by prompt.
        trace_json=json.dumps({"per_slot": False}),
        extra_tokens=reserve_extra(d),
        tokens_per_step=d + 1,
    )
    # The verify rows' union of top-k must fit the LRU slots: B - W >= k (D + 1).
    return replace(base, hot_slots=base.topk * (d + 1) + window)


def run_pairs(
    sizes: plan.Sizes, modes: list[str], draft_tokens: int, recording: str, overlap: bool = True
):
    """Per context and mode: (plain run, speculative run), same N and phases."""
    pairs = []
    for c in sizes.contexts:
        p = plan.plan_context(sizes, c)
        for mode in modes:
            n = p.n_baseline if mode == "baseline" else p.n_hisparse
            phases = (plan.Phase("batch1", 1, sizes.batch1_tokens),)
            # The ramp (one prefill per step) and the steady steps at up to D + 1 tokens each.
            new = (n + sizes.steady_steps) * sizes.tokens_per_step
            phases += (plan.Phase("max", n, new),)
            plain = plan.Run(
                c, mode, "trace", phases, n, sizes.hot_slots, p.max_context, overlap=overlap
            )
            source = f"{REPLAY}:" + json.dumps({"path": recording})
            spec = replace(plain, draft_tokens=draft_tokens, draft_source=source, overlap=True)
            pairs.append((plain, spec))
    return pairs


def prompt_of(sizes: plan.Sizes, context: int, stream: int) -> tuple[int, ...]:
    """The engine's prompt of stream `stream` (bench/e2e/load.py's prompts, after the
    synthetic context's placeholder ids, named by the prompt: engine_client.loop.synthetic)."""
    ids = tuple(prompt_ids(stream, sizes.prompt_len, sizes.vocab))
    return SyntheticContext(context).placeholders(prompt_serial(ids), sizes.vocab) + ids


def record(ctx: dict, sizes: plan.Sizes, run: plan.Run, path: str) -> dict:
    """Write the plain run's greedy tokens (longest per prompt) as the replay's recording."""
    best: dict[tuple[int, ...], list[int]] = {}
    for (label, _), recs in ctx["records"].items():
        if label != run.label:
            continue
        for i, rec in enumerate(recs):
            key = prompt_of(sizes, run.context, i)
            if len(rec["tokens"]) > len(best.get(key, [])):
                best[key] = rec["tokens"]
    write_recording(path, best.items())
    return best


def same_tokens(ctx: dict, sizes: plan.Sizes, run: plan.Run, recorded: dict) -> float | None:
    """Share of the speculative run's streams whose tokens equal the plain run's (greedy
    decoding with and without MTP must agree; GPU rounding of other GEMM shapes may not)."""
    same = [
        rec["tokens"] == recorded.get(prompt_of(sizes, run.context, i), [])[: len(rec["tokens"])]
        for (label, _), recs in ctx["records"].items()
        if label == run.label
        for i, rec in enumerate(recs)
    ]
    return sum(same) / len(same) if same else None


async def run_all(ctx: dict, pairs: list, budget: float | None) -> list[dict]:
    out, longest, i = [], 0.0, 0
    for plain, spec in pairs:
        if budget is not None and time.monotonic() - ctx["t0"] + 2 * longest > budget:
            out.append({"context": plain.context, "mode": plain.mode, "skipped": True})
            continue
        i += 1
        a = await run_one(ctx, plain, i)
        recording = json.loads(spec.draft_source.split(":", 2)[2])["path"]
        recorded = record(ctx, ctx["sizes"], plain, recording)
        i += 1
        b = await run_one(ctx, spec, i)
        for run, res in ((plain, a), (spec, b)):
            for (label, phase), recs in ctx["records"].items():
                if label == run.label and phase in res["phases"]:
                    res["phases"][phase]["window_tok_s"] = window_tok_s(recs)
        longest = max(longest, a["run_s"], b["run_s"])
        out.append(
            {
                "context": plain.context,
                "mode": plain.mode,
                "plain": a,
                "mtp": b,
                "recorded_prompts": len(recorded),
                "same_tokens": same_tokens(ctx, ctx["sizes"], spec, recorded),
            }
        )
        ctx["records"].clear()
    return out


def write_payload(args: argparse.Namespace, ctx: dict, results: list, left: list) -> Path:
    import torch

    sizes = ctx["sizes"]
    name = f"mtp{'-smoke' if args.smoke else ''}-{time.strftime('%Y-%m-%d')}.json"
    out = Path(args.out) if args.out else REPO_ROOT / "bench" / "results" / name
    payload = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "device": (ctx["ceilings"] or {}).get("device", "cpu"),
        "torch": torch.__version__,
        "draft_tokens": args.draft_tokens,
        "plain_overlap": bool(args.plain_overlap),
        "draft_source": "BENCHMARK-ONLY replay (bench/mtp/draft_replay.py)",
        "sizes": asdict(sizes),
        "plans": {str(c): plan.plan_context(sizes, c).to_dict(sizes) for c in sizes.contexts},
        "pairs": results,
        "summary": [dict(context=p["context"], mode=p["mode"], **summary(p)) for p in results],
        "leftover_segments": left,
        "wall_s": time.monotonic() - ctx["t0"],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print_table(payload)
    print(f"\nJSON: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    sizes = sizes_of(args, device)
    workdir = tempfile.mkdtemp(prefix="mtp-", dir="/tmp")
    recording = os.path.join(workdir, "greedy.jsonl")
    modes = args.modes.split(",")
    pairs = run_pairs(sizes, modes, args.draft_tokens, recording, bool(args.plain_overlap))
    children = Children(sizes, workdir, f"mtp{os.getpid()}", 120 if args.smoke else 420)
    load = LoadGen(1 if args.smoke else 4)
    ctx = {
        "children": children,
        "load": load,
        "sizes": sizes,
        "t0": time.monotonic(),
        "records": {},
        "ceilings": measure_ceilings() if device == "cuda" else None,
        "progress": Progress(2 * len(pairs)),
        "stream_timeout": 120.0 if args.smoke else 400.0,
    }
    budget = args.budget_s if args.budget_s is not None else (None if args.smoke else 540.0)
    try:
        results = asyncio.run(run_all(ctx, pairs, budget))
    finally:
        left = children.close()
        load.close()
        shutil.rmtree(workdir, ignore_errors=True)
    write_payload(args, ctx, results, left)
    runs = [r for p in results for r in (p.get("plain"), p.get("mtp")) if r]
    failed = [r for r in runs if r.get("error") or r.get("engine_exit")]
    return 1 if failed or left else 0


if __name__ == "__main__":
    raise SystemExit(main())

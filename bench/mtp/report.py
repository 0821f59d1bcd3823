"""Numbers, table and JSON of bench/mtp/cli.py: per context, mode and D the plain run against the
speculative run, whose drafts are accepted by the BENCHMARK-ONLY synthetic rule (the rates are
stated beside every figure: in the JSON, the table's title and each row)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.e2e import plan
from bench.e2e.stats import steady_window
from bench.shared.result_file import write_json
from engine_client.loop.acceptance_rates import BENCHMARK_ONLY
from engine_client.serve.procs import REPO_ROOT


def window_tok_s(recs: list[dict]) -> float | None:
    """Tokens arriving in the steady window / its length. With speculation tokens arrive in
    bursts of up to D + 1, so e2e's per-stream gap rate would overstate; this counts them, the
    same way for both runs."""
    a, b, _, _ = steady_window(recs)
    if b <= a:
        return None
    return sum(1 for r in recs for t in r["arrivals"] if a < t <= b) / (b - a)


def _get(phases: dict, phase: str, key: str):
    return (phases.get(phase) or {}).get(key)


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def summary(group: dict, d: int, expected: float) -> dict:
    """The numbers issue 41 asks for, of one (context, mode, D); {} for a run not made."""
    spec = group["mtp"].get(str(d))
    if spec is None or "plain" not in group:
        return {}
    a, b = group["plain"]["phases"], spec["phases"]
    accept = _get(b, "max", "acceptance")
    return {
        "N": _get(b, "max", "concurrency"),
        "tok_s": _get(a, "max", "window_tok_s"),
        "tok_s_mtp": _get(b, "max", "window_tok_s"),
        "tok_s_ratio": _ratio(_get(b, "max", "window_tok_s"), _get(a, "max", "window_tok_s")),
        "batch1_itl_mean_s": _get(a, "batch1", "itl_mean_s"),
        "batch1_itl_mean_s_mtp": _get(b, "batch1", "itl_mean_s"),
        "batch1_itl_ratio": _ratio(
            _get(a, "batch1", "itl_mean_s"), _get(b, "batch1", "itl_mean_s")
        ),
        "acceptance": accept,
        # Every live request drafts D per verify step, so it yields 1 + D x acceptance tokens.
        "tokens_per_step": 1 + d * accept if accept is not None else None,
        "tokens_per_step_expected": expected,
        "drafted_per_step": _get(b, "max", "drafted_per_step"),
        "misses_per_step": _get(a, "max", "misses_per_step"),
        "misses_per_step_mtp": _get(b, "max", "misses_per_step"),
        "misses_rows_per_step_mtp": _get(b, "max", "misses_rows_per_step"),
    }


def _fmt(v: float | None, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v * scale)


def _stepping(overlap: bool) -> str:
    return "overlap steps" if overlap else "wait for every step"


def print_table(payload: dict) -> None:
    sizes = payload["sizes"]
    layers = f" at {sizes['layers']} layers" if sizes.get("layers") else ""
    print(
        f"\nMTP vs plain decoding, {payload['device']}, preset {sizes['preset']}{layers}, "
        f"{payload['sizes']['row_format']} rows, drafts accepted by {payload['acceptance']}; "
        f"speculative runs {_stepping(payload.get('mtp_overlap', False))}, plain runs "
        f"{_stepping(payload['plain_overlap'])}"
    )
    head = (
        f"{'context':>8} {'mode':<10} {'D':>2} {'rates':<14} {'N':>4} {'tok/s':>9} {'mtp':>9} "
        f"{'x':>5} {'ITL1 ms':>8} {'mtp':>8} {'tok/st':>6} {'expect':>6} {'miss/st':>9} "
        f"{'union':>9} {'rows':>9}"
    )
    print(head + "\n" + "-" * len(head))
    for row in payload["summary"]:
        if not row.get("N"):
            print(f"{row['context']:>8} {row['mode']:<10} {row['D']:>2} not run (budget or error)")
            continue
        print(
            f"{row['context']:>8} {row['mode']:<10} {row['D']:>2} {row['rates']:<14} "
            f"{row['N']:>4} {_fmt(row['tok_s']):>9} {_fmt(row['tok_s_mtp']):>9} "
            f"{_fmt(row['tok_s_ratio'], 1, '{:.2f}'):>5} "
            f"{_fmt(row['batch1_itl_mean_s'], 1e3, '{:.2f}'):>8} "
            f"{_fmt(row['batch1_itl_mean_s_mtp'], 1e3, '{:.2f}'):>8} "
            f"{_fmt(row['tokens_per_step'], 1, '{:.2f}'):>6} "
            f"{_fmt(row['tokens_per_step_expected'], 1, '{:.2f}'):>6} "
            f"{_fmt(row['misses_per_step']):>9} {_fmt(row['misses_per_step_mtp']):>9} "
            f"{_fmt(row['misses_rows_per_step_mtp']):>9}"
        )
    print(
        "tok/s at max N (same N both ways); ITL1: batch-1 mean gap; tok/st: tokens per verify "
        "step per request, measured and expected from the rates; miss/st: swap misses per "
        "engine step: plain, MTP as copied (the verify rows' union), MTP summed over the rows "
        f"(without the union). Acceptance: {BENCHMARK_ONLY} synthetic, not the model's."
    )


def _summaries(args: argparse.Namespace, results: list) -> list[dict]:
    rows = []
    for group in results:
        for d in args.draft_tokens:
            rule = args.rules[d]
            rates = ",".join(f"{r:g}" for r in rule.per_position)
            # "+bi": the run with --batch-invariant 1.
            mode = group["mode"] + ("+bi" if group.get("batch_invariant") else "")
            head = dict(context=group["context"], mode=mode, D=d, rates=rates)
            rows.append(head | summary(group, d, rule.tokens_per_step))
    return rows


def write_payload(
    args: argparse.Namespace, ctx: dict, results: list, left: list, complete: bool = True
) -> Path:
    """The JSON; "complete": false while runs remain (rewritten after each, quietly)."""
    import torch

    sizes = ctx["sizes"]
    name = f"mtp{'-smoke' if args.smoke else ''}-{time.strftime('%Y-%m-%d')}.json"
    out = Path(args.out) if args.out else REPO_ROOT / "bench" / "results" / name
    payload = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "device": (ctx["ceilings"] or {}).get("device", "cpu"),
        "torch": torch.__version__,
        "draft_tokens": list(args.draft_tokens),
        "acceptance": f"{BENCHMARK_ONLY} synthetic acceptance (engine_client/loop/"
        f"synthetic_acceptance.py), rates {args.speculative_acceptance}, seed "
        f"{args.acceptance_seed}",
        "plain_overlap": bool(args.plain_overlap),
        "mtp_overlap": bool(args.mtp_overlap),
        "batch_invariant": list(args.batch_invariant),
        "sizes": asdict(sizes),
        "plans": {str(c): plan.plan_context(sizes, c).to_dict(sizes) for c in sizes.contexts},
        "groups": results,
        "summary": _summaries(args, results),
        "leftover_segments": left,
        "wall_s": time.monotonic() - ctx["t0"],
        "complete": complete,
    }
    write_json(payload, out)  # atomic: a stage killed mid-write keeps the previous JSON
    if not complete:
        return out
    print_table(payload)
    print(f"\nJSON: {out}")
    return out

"""Speculative decoding (MTP) benchmark (issues 22, 41): tokens/s with --speculative mtp vs
without, in the all-on-GPU baseline and HiSparse's service mode, at D = 1, 2 and 3 drafts per
step, with drafts accepted by the BENCHMARK-ONLY synthetic rule at set rates
(engine_client/loop/synthetic_acceptance.py, as vLLM's synthetic rejection sampler). Everything
else is real: the MTP layer drafts, each verify step runs D + 1 rows per request through every
layer with the union swap plan, and rejected rows are rolled back. The model's random weights
would otherwise accept almost nothing; the rates stand in for V3.2's published ones (~0.9 at
D = 1: ~1.9 tokens per step; 2.65-2.96 tokens per step at D = 3).

    python -m bench.mtp                                  # GPU: 32K and 128K, D = 1,2,3
    python -m bench.mtp --contexts 32768 --draft-tokens 1 --speculative-acceptance 0.9
    python -m bench.mtp --smoke                          # CPU: tiny preset, the whole harness
    python -m bench.mtp --contexts 32768 --draft-tokens 1 --speculative-acceptance 0.9 \
        --batch-invariant 0,1                            # the cost of --batch-invariant 1
    python -m bench.mtp ... --mtp-overlap 0              # MTP waiting for every step

--speculative-acceptance gives conditional rates per draft position (rate i: draft i accepted
given the drafts before it were); a run at D takes the first D (fewer: the last repeats).
Per context and mode: the run without speculation (phases batch1 and max), then one speculative
run per D, all at the same N: every run of one command is sized for its largest D (the LRU
slots hold the union of D + 1 rows' top-k, B = k (D + 1) + W, and admission reserves its rows),
so run D = 1 alone for D = 1's own N; with --host-reads 1, B = k + W whatever D, and the union's
misses past the victims are read from the host tier. Max-phase streams generate (N + steady
steps) (D + 1) tokens, so a speculative run still has a steady window of steady steps at full
concurrency.
Reported per context, mode and D: tok/s without / with and the ratio, batch-1 mean ITL without /
with (tokens arrive in bursts, so the mean gap), tokens per verify step per request (measured:
1 + D x acceptance; expected from the rates), and swap misses per step: plain, MTP as copied
(the verify rows' union) and MTP summed over the rows (without the union). JSON to
bench/results/mtp-<date>.json (labelled BENCHMARK-ONLY), a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from dataclasses import replace
from functools import partial

from bench.e2e import plan
from bench.e2e.children import Children, Progress
from bench.e2e.cli import GIB
from bench.e2e.load import LoadGen
from bench.e2e.runs import measure_ceilings, run_one
from bench.mtp.options import checked, default_kv_gib, engine_options
from bench.mtp.report import window_tok_s, write_payload
from engine_client.loop.acceptance_rates import BENCHMARK_ONLY
from engine_client.loop.speculative import reserve_extra


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset and sizes")
    ap.add_argument("--out", default="", help="JSON path [bench/results/mtp-<date>.json]")
    ap.add_argument("--contexts", default="", help="comma-separated [32768,131072; smoke 256]")
    ap.add_argument("--draft-tokens", default="1,2,3", help="the Ds to run, comma-separated")
    ap.add_argument(
        "--speculative-acceptance",
        default="0.9,0.75,0.6",
        help=f"{BENCHMARK_ONLY}: synthetic acceptance rates per draft position (D takes the "
        "first D; 1.0 accepts every draft, 0 none)",
    )
    ap.add_argument("--acceptance-seed", type=int, default=0, help="seed of the draws")
    ap.add_argument("--modes", default="baseline,service")
    ap.add_argument("--row-format", default="", help="KV rows [fp8; smoke bf16]")
    ap.add_argument(
        "--layers",
        type=int,
        default=0,
        help="decoder layers of the model (the engines' --num-layers) [the preset's: bench 4, "
        "smoke 2]. At batch 1 a step reads its weights: the draft (the MTP layer, 1.42 GB in "
        "bf16, and one more output-head pass, 1.85 GB) adds 44%% to the 4-layer preset's 7.5 GB "
        "and 13%% at 16 layers (V3.2's 61: ~4%%), so the batch-1 MTP/plain ratio depends on it "
        "(docs/BENCHMARKS.md, run X3). Host tier and weights grow with it: 16 layers at 32K "
        "fit an H100",
    )
    ap.add_argument(
        "--gpu-kv-gib",
        type=float,
        default=None,
        help="GPU KV budget [6 x (layers + 1) / 5: the 4-layer runs' budget a KV layer, so N "
        "stays theirs; smoke 2 MiB]",
    )
    ap.add_argument("--steady-steps", type=int, default=None, help="[128; smoke 8]")
    ap.add_argument("--budget-s", type=float, default=None, help="skip runs past this [540]")
    engine_options(ap)
    return checked(ap, ap.parse_args(argv))


def sizes_of(args: argparse.Namespace, device: str) -> plan.Sizes:
    smoke, d = args.smoke, max(args.draft_tokens)
    window, model = (8, "tiny") if smoke else (128, "bench")
    base = plan.Sizes(
        preset=model,
        contexts=tuple(
            int(c) for c in (args.contexts or ("256" if smoke else "32768,131072")).split(",")
        ),
        gpu_kv_bytes=int((args.gpu_kv_gib or default_kv_gib(smoke, args.layers)) * GIB),
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
        extra_tokens=reserve_extra(d),
        tokens_per_step=d + 1,
        layers=args.layers,
        host_reads=bool(args.host_reads),
    )
    # The verify rows' union of top-k must fit the LRU slots, B - W >= k (D + 1), unless the
    # misses past them are read from the host tier.
    rows = 1 if args.host_reads else d + 1
    return replace(base, hot_slots=base.topk * rows + window)


def run_groups(sizes: plan.Sizes, args: argparse.Namespace) -> list[tuple[plan.Run, list]]:
    """Per context, mode and --batch-invariant value: the plain run and one speculative run
    per D, same N and phases."""
    groups = []
    for c in sizes.contexts:
        p = plan.plan_context(sizes, c)
        for mode, bi in ((m, b) for m in args.modes.split(",") for b in args.batch_invariant):
            n = p.n_baseline if mode == "baseline" else p.n_hisparse
            # The ramp (one prefill per step) and the steady steps at up to D + 1 tokens each.
            new = (n + sizes.steady_steps) * sizes.tokens_per_step
            phases = (plan.Phase("batch1", 1, sizes.batch1_tokens), plan.Phase("max", n, new))
            plain = plan.Run(
                c,
                mode,
                "trace",
                phases,
                n,
                sizes.hot_slots,
                p.max_context,
                overlap=bool(args.plain_overlap),
                batch_invariant=bi,
            )
            spec = [
                replace(
                    plain,
                    draft_tokens=d,
                    acceptance=args.rules[d].rates,
                    acceptance_seed=args.acceptance_seed,
                    overlap=bool(args.mtp_overlap),
                )
                for d in args.draft_tokens
            ]
            groups.append((plain, spec))
    return groups


async def _measured(ctx: dict, run: plan.Run, i: int) -> dict:
    """One run, with its phases' steady-window tok/s counted from the streams' arrivals."""
    res = await run_one(ctx, run, i)
    for (label, phase), recs in ctx["records"].items():
        if label == run.label and phase in res["phases"]:
            res["phases"][phase]["window_tok_s"] = window_tok_s(recs)
    ctx["records"].clear()
    return res


async def run_all(ctx: dict, groups: list, budget: float | None, save=None) -> list[dict]:
    """Every group's runs in turn; `save(results so far)` after each run, so a run cut by its
    time limit keeps what it measured."""
    out, longest, i = [], 0.0, 0
    for plain, spec in groups:
        group: dict = {
            "context": plain.context,
            "mode": plain.mode,
            "batch_invariant": plain.batch_invariant,
            "mtp": {},
        }
        out.append(group)
        for run in [plain, *spec]:
            if budget is not None and time.monotonic() - ctx["t0"] + longest > budget:
                group.setdefault("skipped", []).append(run.draft_tokens)
                continue
            i += 1
            res = await _measured(ctx, run, i)
            longest = max(longest, res["run_s"])
            if run.draft_tokens:
                group["mtp"][str(run.draft_tokens)] = res
            else:
                group["plain"] = res
            if save is not None:
                save(out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    sizes = sizes_of(args, device)
    workdir = tempfile.mkdtemp(prefix="mtp-", dir="/tmp")
    groups = run_groups(sizes, args)
    children = Children(sizes, workdir, f"mtp{os.getpid()}", 120 if args.smoke else 420)
    load = LoadGen(1 if args.smoke else 4)
    ctx = {
        "children": children,
        "load": load,
        "sizes": sizes,
        "t0": time.monotonic(),
        "records": {},
        "ceilings": measure_ceilings() if device == "cuda" else None,
        "progress": Progress(sum(1 + len(spec) for _, spec in groups)),
        "stream_timeout": 120.0 if args.smoke else 400.0,
    }
    budget = args.budget_s if args.budget_s is not None else (None if args.smoke else 540.0)
    try:
        save = partial(write_payload, args, ctx, left=[], complete=False)
        results = asyncio.run(run_all(ctx, groups, budget, save))
    finally:
        left = children.close()
        load.close()
        shutil.rmtree(workdir, ignore_errors=True)
    write_payload(args, ctx, results, left=left)
    runs = [r for g in results for r in (g.get("plain"), *g["mtp"].values()) if r]
    failed = [r for r in runs if r.get("error") or r.get("engine_exit")]
    return 1 if failed or left else 0


if __name__ == "__main__":
    raise SystemExit(main())

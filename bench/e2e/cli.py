"""End-to-end decode benchmark (issue 5): baseline vs embedded vs service vs service-remote-swap
at an equal GPU KV budget, with the kv service and the engine as separate processes.

    python -m bench.e2e                 # GPU: contexts 32K and 128K, preset bench (< 10 min)
    python -m bench.e2e --smoke         # CPU: tiny preset and sizes, the whole harness (~1 min)
    python -m bench.e2e --row-formats bf16,fp8   # every run once per KV row format

Per context, each run starts `python -m engine_client serve` (and `python -m kv_service`, shared
by the service-mode runs of a context) on sockets in a temp dir, waits for grpc health, and
drives it with N concurrent decode.v1 Generate streams from worker processes. Every request is
a synthetic context (engine --synthetic-context: random KV, no prefill) + a short prompt.
Phases: batch1 (one stream), equal (baseline's max concurrency), max (the mode's own max in the
budget G; see bench/e2e/plan.py). Top-k: the replayed trace (bench/shared/trace.py, calibrated to
published miss rates) in every mode, and the random model's own indexer (near-zero reuse).
Progress goes to stderr; JSON (+ PNG charts with matplotlib) to bench/results; a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.e2e import plan
from bench.e2e.children import Children, Progress
from bench.e2e.engine_args import add_engine_args
from bench.e2e.load import LoadGen
from bench.e2e.report import charts, print_table
from bench.e2e.roofline import analyze as roofline
from bench.e2e.row_formats import print_summary, probe_attention
from bench.e2e.runs import measure_ceilings, run_all
from bench.e2e.stats import ratios
from bench.shared.result_file import write_json
from bench.shared.trace import TraceParams, simulate
from engine_client.serve.procs import REPO_ROOT

GIB = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset and sizes")
    ap.add_argument("--out", default="", help="JSON path [bench/results/e2e-<date>.json]")
    _add_size_args(ap)
    _add_run_args(ap)
    add_engine_args(ap)
    _add_budget_args(ap)
    return ap.parse_args(argv)


def _add_size_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--contexts", default="", help="comma-separated [32768,131072; smoke 256]")
    ap.add_argument(
        "--gpu-kv-gib", type=float, default=None, help="GPU KV budget G [6; smoke 2 MiB]"
    )
    ap.add_argument("--hot-slots", type=int, default=None, help="B [4096; smoke 32]")
    ap.add_argument("--window", type=int, default=None, help="W [128; smoke 8]")
    ap.add_argument(
        "--host-reads",
        type=int,
        default=0,
        choices=(0, 1),
        help="1: the HiSparse layouts' host_reads, so --hot-slots may be below W + k and "
        "attention reads the misses past the victims from the host tier (issue 40) [0]",
    )
    ap.add_argument(
        "--steady-steps",
        type=int,
        default=None,
        help="decode steps at full concurrency per phase [128; smoke 8]",
    )


def _add_run_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--modes", default=",".join(plan.MODES))
    ap.add_argument("--sources", default="trace,indexer", help="top-k sources: trace, indexer")
    ap.add_argument("--no-sweep", action="store_true", help="skip the hit-rate-vs-B runs")
    ap.add_argument(
        "--client-procs", type=int, default=None, help="load worker processes [4; smoke 1]"
    )


def _add_budget_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip runs that would end after this many seconds [540; smoke none]; per row format",
    )
    ap.add_argument(
        "--row-formats",
        default="bf16",
        help="KV row formats, each a full run "
        "(baseline and HiSparse in the same format): bf16 (1152 B), fp8 (656 B); "
        "with several, each JSON gets a -<format> suffix and a summary is printed",
    )


def sizes_from_args(args: argparse.Namespace, device: str) -> plan.Sizes:
    smoke = args.smoke
    ctxs = args.contexts or ("256" if smoke else "32768,131072")
    gib = args.gpu_kv_gib if args.gpu_kv_gib is not None else (2 / 1024 if smoke else 6.0)
    pick = lambda v, small, big: v if v is not None else (small if smoke else big)  # noqa: E731
    return plan.Sizes(
        preset="tiny" if smoke else "bench",
        contexts=tuple(int(c) for c in ctxs.split(",")),
        gpu_kv_bytes=int(gib * GIB),
        hot_slots=pick(args.hot_slots, 32, 4096),
        window=pick(args.window, 8, 128),
        page_size=16 if smoke else 64,
        prompt_len=8 if smoke else 16,
        steady_steps=pick(args.steady_steps, 8, 128),
        batch1_tokens=8 if smoke else 64,
        device=device,
        sweep_requests=4 if smoke else 16,
        sweep_factors=() if args.no_sweep else (1, 4),
        decode_microbatches=args.microbatches,
        admission_limit=args.admission_limit,
        decode_part_tail=args.decode_part_tail,
        late_queries=args.late_queries,
        copy_priority=args.copy_priority,
        copy_grid=args.copy_grid,
        host_reads=bool(args.host_reads),
    )


def default_out(smoke: bool) -> Path:
    return (
        REPO_ROOT
        / "bench"
        / "results"
        / f"e2e{'-smoke' if smoke else ''}-{time.strftime('%Y-%m-%d')}.json"
    )


def build_payload(
    args: argparse.Namespace,
    sizes: plan.Sizes,
    ceilings: dict | None,
    sims: tuple[dict, dict],
    results: list,
    skipped: list,
    left: list,
    out: Path,
    t0: float,
) -> dict:
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "device": (ceilings or {}).get("device", "cpu"),
        "torch": torch.__version__,
        "smoke": args.smoke,
        "sizes": {**asdict(sizes), "num_layers": sizes.num_layers, "topk": sizes.topk},
        "plans": {str(c): plan.plan_context(sizes, c).to_dict(sizes) for c in sizes.contexts},
        "ceilings": ceilings,
        "trace_params": asdict(TraceParams()),
        "trace_simulated": {str(c): m for c, m in sims[0].items()},
        "trace_simulated_request_life": {str(c): m for c, m in sims[1].items()},
        "runs": results,
        "skipped": skipped,
        "leftover_segments": left,
        "out": str(out),
        "ratios": ratios(results, list(sizes.contexts), args.sources.split(",")),
        "wall_s": time.monotonic() - t0,
    }


def simulate_trace(sizes: plan.Sizes, steady_steps: int) -> tuple[dict, dict]:
    """Simulated miss rates of the trace at LRU capacity k, 2k, 4k: steady state, and over one
    sweep request's life (cold hot buffer after the fill included), which is what the engine's
    per-request counters see."""
    steady = simulate(
        TraceParams(), sizes.topk, sizes.contexts[0], sizes.window, steps=steady_steps, warmup=40
    )
    life = simulate(
        TraceParams(),
        sizes.topk,
        sizes.contexts[0],
        sizes.window,
        steps=sizes.sweep_requests + sizes.steady_steps,
        warmup=0,
    )
    return steady, life


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    ceilings = measure_ceilings() if device == "cuda" else None
    formats = args.row_formats.split(",")
    payloads, code = [], 0
    for fmt in formats:
        sizes = replace(sizes_from_args(args, device), row_format=fmt)
        suffix = f"-{fmt}" if len(formats) > 1 else ""
        payload, failed = run_format(args, sizes, ceilings, suffix)
        payloads.append(payload)
        code = code or failed
    if len(formats) > 1 or formats != ["bf16"]:
        print_summary(payloads)
    return code


def run_format(
    args: argparse.Namespace, sizes: plan.Sizes, ceilings: dict | None, suffix: str
) -> tuple[dict, int]:
    """The whole matrix in one row format: (payload, 1 if a run failed or left segments)."""
    t0, device = time.monotonic(), sizes.device
    runs = plan.build_matrix(sizes, tuple(args.modes.split(",")), tuple(args.sources.split(",")))
    sims = simulate_trace(sizes, 200 if device == "cuda" else 120)
    budget = args.budget_s if args.budget_s is not None else (None if args.smoke else 540.0)
    workdir = tempfile.mkdtemp(prefix="e2e-", dir="/tmp")
    children = Children(sizes, workdir, f"e2e{os.getpid()}", 120 if args.smoke else 420)
    load = LoadGen(args.client_procs or (1 if args.smoke else 4))
    ctx = {
        "children": children,
        "load": load,
        "sizes": sizes,
        "ceilings": ceilings,
        "t0": t0,
        "progress": Progress(len(runs)),
        "stream_timeout": 120.0 if args.smoke else 400.0,
    }
    try:
        results, skipped = asyncio.run(run_all(ctx, runs, budget))
    finally:
        left = children.close()
        load.close()
        shutil.rmtree(workdir, ignore_errors=True)
    out = Path(args.out) if args.out else default_out(args.smoke)
    out = out.with_name(out.stem + suffix + out.suffix)
    payload = build_payload(args, sizes, ceilings, sims, results, skipped, left, out, t0)
    if device == "cuda":
        n = sorted({plan.plan_context(sizes, c).n_hisparse for c in sizes.contexts})
        payload["attention_probe"] = probe_attention(sizes.row_format, n)
    payload["roofline"] = roofline(payload)
    payload["charts"] = charts(payload, out)
    write_json(payload, out)
    print_table(payload)
    failed = [r for r in results if r.get("error") or r.get("engine_exit")]
    return payload, 1 if failed or left else 0


if __name__ == "__main__":
    raise SystemExit(main())

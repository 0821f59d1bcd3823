"""Gateway benchmark (issue 21): what the OpenAI-compatible HTTP gateway adds per token, and its
throughput, against the engine's gRPC Generate in the same run.

    python -m bench.gateway                                  # GPU: preset bench, 64 streams
    python -m bench.gateway --streams 174 --context 32768    # at max N of the 32K e2e plan
    python -m bench.gateway --smoke                          # CPU: tiny preset, a few streams

Starts a KV service, an engine (service mode, --synthetic-context for long contexts) and the
gateway as its own process (as in compose), then alternates phases of N concurrent streams
through gRPC and through HTTP (SSE), --rounds times each, with the same text prompts and
seeds. Reports per route: tokens/s, time to first text, gaps between text events (p50, p99,
mean); and HTTP minus gRPC per event, HTTP / gRPC throughput. JSON to bench/results.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.gateway.load import run_streams
from bench.shared.child import SHM_DIR
from contract import flags
from contract.layout import KVLayout
from engine_client.model.preset import preset
from engine_client.serve.procs import ManagedProcess, engine_process, service_process

URL_RE = re.compile(r"gateway listening on (http://\S+)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, 2 streams")
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams per phase")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per stream")
    ap.add_argument("--context", type=int, default=0, help="synthetic context tokens per stream")
    ap.add_argument("--words", type=int, default=8, help="words of each text prompt")
    ap.add_argument("--rounds", type=int, default=2, help="gRPC and HTTP phases, alternated")
    ap.add_argument("--workers", type=int, default=4, help="client processes per phase")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--hot-slots", type=int, default=4096)
    ap.add_argument("--out", default="", help="JSON path [bench/results/gateway-<date>.json]")
    args = ap.parse_args(argv)
    if args.smoke:
        args.streams, args.tokens, args.rounds, args.workers = 2, 8, 1, 1
        args.preset, args.hot_slots = "tiny", 32
    return args


def layout(args: argparse.Namespace, device: str) -> KVLayout:
    cfg = preset(args.preset)
    page = 16 if device == "cpu" else 64
    need = args.context + 8 * args.words + args.tokens + page
    max_context = -(-need // page) * page
    return KVLayout(
        num_layers=cfg.num_layers,
        max_requests=args.streams,
        hot_slots=args.hot_slots,
        window=8 if device == "cpu" else 128,
        topk=cfg.topk,
        page_size=page,
        num_pages=args.streams * max_context // page,
        max_context=max_context,
    )


def wait_url(proc: ManagedProcess, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.alive():
        found = URL_RE.search(proc.log(None))
        if found:
            return found[1]
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} did not listen:\n{proc.log()}")


def start(
    args: argparse.Namespace, workdir: str, device: str
) -> tuple[list[ManagedProcess], str, str]:
    """The children (stop order: gateway, engine, service), the engine's target and the
    gateway's URL."""
    lay = layout(args, device)
    svc = service_process(workdir, "gwbench", flags.to_flags(lay), device=device, shm_dir=SHM_DIR)
    procs = [svc.start()]
    svc.wait_serving(600)
    extra = ["--preset", args.preset, "--device", device, "--max-batch", str(args.streams)]
    extra += ["--synthetic-context", str(args.context), "--max-queue-wait", "0"]
    eng = engine_process(workdir, "service", service_uds=svc.target[5:], extra=extra)
    procs.insert(0, eng.start())
    eng.wait_serving(900)
    gw_args = [sys.executable, "-m", "engine_client", "gateway", "--target", eng.target]
    gw = ManagedProcess(
        "gateway", gw_args + ["--http", "127.0.0.1:0"], f"{workdir}/gateway.log", "", ""
    )
    procs.insert(0, gw.start())
    return procs, eng.target, wait_url(gw, 60)


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def summarize(records: list[dict], wall: float) -> dict:
    ttft = [r["arrivals"][0] for r in records if r["arrivals"]]
    gaps = [b - a for r in records for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tokens = sum(r["tokens"] for r in records)
    return {
        "streams": len(records),
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "text_events": sum(len(r["arrivals"]) for r in records),
        "ttft_ms_p50": 1e3 * pct(ttft, 0.5),
        "ttft_ms_p99": 1e3 * pct(ttft, 0.99),
        "gap_ms_p50": 1e3 * pct(gaps, 0.5),
        "gap_ms_p99": 1e3 * pct(gaps, 0.99),
        "gap_ms_mean": 1e3 * statistics.fmean(gaps) if gaps else 0.0,
    }


def measure(args: argparse.Namespace, targets: dict[str, str]) -> dict[str, list[dict]]:
    for route, where in targets.items():  # warm-up: first requests, first connections
        run_streams(route, where, 1, args.words, 4, 1)
    phases: dict[str, list[dict]] = {"grpc": [], "http": []}
    for r in range(args.rounds):
        for route, where in targets.items():
            records, wall = run_streams(
                route, where, args.streams, args.words, args.tokens, args.workers
            )
            phases[route].append(summarize(records, wall))
            print(f"round {r} {route}: {phases[route][-1]}", file=sys.stderr, flush=True)
    return phases


def compare(phases: dict[str, list[dict]]) -> dict:
    def mean(route: str, key: str) -> float:
        return statistics.fmean(p[key] for p in phases[route])

    return {
        "http_minus_grpc_gap_ms_mean": mean("http", "gap_ms_mean") - mean("grpc", "gap_ms_mean"),
        "http_minus_grpc_gap_ms_p50": mean("http", "gap_ms_p50") - mean("grpc", "gap_ms_p50"),
        "http_minus_grpc_ttft_ms_p50": mean("http", "ttft_ms_p50") - mean("grpc", "ttft_ms_p50"),
        "http_over_grpc_tok_per_s": mean("http", "tok_per_s") / mean("grpc", "tok_per_s"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    with tempfile.TemporaryDirectory(prefix="gwb-", dir="/tmp") as workdir:
        children, target, url = start(args, workdir, device)
        try:
            phases = measure(args, {"grpc": target, "http": url})
        finally:
            for p in children:
                p.stop()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "args": vars(args),
        "phases": phases,
        "compare": compare(phases),
    }
    out = Path(args.out or f"bench/results/gateway-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'route':6} {'tok/s':>9} {'TTFT p50':>9} {'gap p50':>8} {'gap p99':>8} {'gap mean':>9}")
    for route, ps in phases.items():
        for p in ps:
            print(
                f"{route:6} {p['tok_per_s']:9.1f} {p['ttft_ms_p50']:8.1f}m {p['gap_ms_p50']:7.2f}m"
                f" {p['gap_ms_p99']:7.2f}m {p['gap_ms_mean']:8.2f}m"
            )
    print(json.dumps(result["compare"]), f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

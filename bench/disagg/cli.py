"""Disaggregation benchmark (issue 42): time to first token, decode inter-token latency and KV
transfer GB/s of prefill/decode disaggregation over NIXL, against the colocated engine (role
both) in the same run, every process on this machine (one GPU: all engines share it).

    python -m bench.disagg                                   # GPU: preset bench, 1x1, auto
    python -m bench.disagg --topologies 1x1,2x2 --sources direct,staged
    python -m bench.disagg --smoke                           # CPU: tiny preset, a few streams

Each run starts its own KV service and engines (colocated: one engine of role both; PxD: P
prefill engines, D decode engines listing them all), warms every engine and peer with a prompt
of --prompt tokens, then loads the decode side (bench/disagg/load.py): --streams prompts at once
decoding (max N) until the arrivals' window ends (at most --tokens each), and once they decode,
--arrivals more prompts --interval s apart. Reported per run: the arrivals' TTFT, the burst's
TTFT, the background's ITL (p50, p99, mean) while the arrivals come in and its tokens/s there,
and for a disaggregated run the KV bytes written over NIXL per prompt and GB/s (bytes / the
prefill engines' write seconds, prefill.v1 Status). The pinned copy is the same bytes in one
device-to-pinned-host copy (CPU: a host copy), the bound a transfer could reach. JSON to
bench/results, rewritten after each run (a run cut short by a time limit keeps the ones before).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.disagg import load, options, stack
from bench.shared.child import run_python
from bench.shared.result_file import write_json
from engine_client.model.preset import preset


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return options.parse_args(argv, __doc__ or "")


def measure(args: argparse.Namespace, workdir: str, device: str, topology, source: str) -> dict:
    """One run: its stack started, warmed up, loaded and stopped."""
    batch = args.streams + args.arrivals
    gpus = options.prefill_gpus(args.prefill_gpus)
    shape = stack.Shape(
        args.preset,
        device,
        batch,
        args.prefill_batch,
        args.prefill_chunk,
        gpus,
        options.speculation(args),
    )
    vocab = preset(args.preset).vocab_size
    os.makedirs(workdir)
    procs = stack.start(workdir, options.layout(args), shape, topology, source)
    try:
        n = len(procs.decode) * max(1, len(procs.prefill))
        load.warm(procs.decode, load.prompts(n, args.prompt, vocab, seed=1))
        before = stack.transfer_totals(procs.prefill) if procs.prefill else None
        background = load.prompts(batch, args.prompt, vocab)
        work = load.Load(
            background[: args.streams],
            args.tokens,
            background[args.streams :],
            args.arrival_tokens,
            args.interval,
        )
        done = load.run(procs.decode, work)
        after = stack.transfer_totals(procs.prefill) if procs.prefill else None
    finally:
        procs.stop()
    name = "colocated" if topology is None else f"{topology[0]}x{topology[1]}-{source}"
    run = {"name": name, **load.summarize(done)}
    if before is not None and after is not None:
        run["transfer"] = transfer(before, after)
    print(f"{name}: {json.dumps(run)}", file=sys.stderr, flush=True)
    return run


def transfer(before: dict, after: dict) -> dict:
    """The run's exports: `gb_per_s` is bytes over the writes' seconds summed (one write's
    rate), `busy_gb_per_s` bytes over the seconds a write was under way (writes overlap: the
    rate while writing, summed over prefill engines' busy seconds)."""
    nbytes, seconds = after["bytes"] - before["bytes"], after["seconds"] - before["seconds"]
    busy = after["busy_seconds"] - before["busy_seconds"]
    exports = after["exports"] - before["exports"]
    return {
        "exports": exports,
        "dropped": after["dropped"] - before["dropped"],
        "bytes_per_prompt": nbytes / exports if exports else 0,
        "write_ms_mean": 1e3 * seconds / exports if exports else 0.0,
        "gb_per_s": nbytes / seconds / 1e9 if seconds else 0.0,
        "busy_s": busy,
        "busy_gb_per_s": nbytes / busy / 1e9 if busy else 0.0,
        # Each region's part of a write (rows into the host tier; index keys into the decode
        # side's host mirror of its index pool on a GPU, kv_service/memory/index_landing.py).
        "region_ms_mean": {
            name: 1e3 * (seconds - before["region_seconds"].get(name, 0.0)) / exports
            for name, seconds in after["region_seconds"].items()
            if exports
        },
        "memory_type": after["memory_type"],
    }


PINNED_COPY = """
import sys, time, torch
n, device = int(sys.argv[1]), sys.argv[2]
src = torch.ones(n, dtype=torch.uint8, device=device)
dst = torch.empty(n, dtype=torch.uint8, pin_memory=device == "cuda")
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
for _ in range(3):
    dst.copy_(src, non_blocking=True)
sync()
start = time.perf_counter()
for _ in range(20):  # back to back: the copy engine's rate, no launch gap per copy
    dst.copy_(src, non_blocking=True)
sync()
print(20 * n / (time.perf_counter() - start) / 1e9)
"""


def pinned_copy_gbps(nbytes: int, device: str) -> float:
    """GB/s of one copy of `nbytes` from the device to pinned host memory (a child process:
    no CUDA context here)."""
    done = run_python(PINNED_COPY, [str(max(1, int(nbytes))), device], timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"pinned copy failed:\n{done.stderr}")
    return float(done.stdout.split()[-1])


def compare(runs: list[dict], pinned: float) -> dict:
    """Each disaggregated run against the colocated one (ratios: disaggregated / colocated)."""
    base = next((r for r in runs if r["name"] == "colocated"), None)
    out = {}
    for r in runs:
        if r["name"] == "colocated":
            continue
        t = r["transfer"]
        row = {
            "gb_per_s_over_pinned_copy": t["gb_per_s"] / pinned if pinned else 0,
            "busy_gb_per_s_over_pinned_copy": t["busy_gb_per_s"] / pinned if pinned else 0,
        }
        if base is not None:
            row["same_tokens"] = r["tokens_sha1"] == base["tokens_sha1"]
            for key in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"):
                row[key + "_ratio"] = r[key] / base[key] if base[key] else 0.0
        out[r["name"]] = row
    return out


def report(result: dict) -> None:
    head = f"{'run':16} {'TTFT p50':>9} {'TTFT p99':>9} {'burst p50':>9} {'ITL p50':>8}"
    print(head + f" {'ITL p99':>8} {'dec tok/s':>9} {'MB/prompt':>9} {'GB/s':>7} {'busy':>7}")
    for r in result["runs"]:
        t = r.get("transfer", {})
        print(
            f"{r['name']:16} {r['ttft_ms_p50']:8.1f}m {r['ttft_ms_p99']:8.1f}m"
            f" {r['burst_ttft_ms_p50']:8.1f}m {r['itl_ms_p50']:7.2f}m {r['itl_ms_p99']:7.2f}m"
            f" {r['decode_tok_per_s']:9.1f} {t.get('bytes_per_prompt', 0) / 1e6:9.2f}"
            f" {t.get('gb_per_s', 0):7.2f} {t.get('busy_gb_per_s', 0):7.2f}"
        )
    print(f"pinned copy: {result['pinned_copy_gb_per_s']:.2f} GB/s")
    for r in result["runs"]:
        parts = r.get("transfer", {}).get("region_ms_mean", {})
        if parts:
            each = ", ".join(f"{name} {ms:.1f} ms" for name, ms in parts.items())
            print(f"{r['name']}: a write's parts, posted to done: {each}")
        if r["max_n_share"] < 1.0:
            print(
                f"{r['name']}: the background decoded at max N for {100 * r['max_n_share']:.1f}%"
                " of the arrivals' window only (a stream reached --tokens first): raise it"
            )
    print("GB/s: bytes over the writes' seconds summed (one write's rate); busy: over the")
    print("seconds any write was under way (the rate while writing, writes overlapping)")
    if any(row.get("same_tokens") is False for row in result["compare"].values()):
        print(
            "same_tokens false: the runs batch differently (a prefill engine's batches against"
            " chunks mixed into decode steps) and GPU kernels are not batch-invariant; greedy"
            " equality at equal batches is tests/integration/test_disaggregation_gpu.py's"
        )
    print(json.dumps(result["compare"]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.prefill_gpus:
        options.prefill_gpus(
            args.prefill_gpus, torch.cuda.device_count() if device == "cuda" else 0
        )
    plan: list[tuple[tuple[int, int] | None, str]] = [] if args.no_colocated else [(None, "")]
    plan += [(t, s) for t in options.topologies(args.topologies) for s in args.sources.split(",")]
    runs: list[dict] = []
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "gpus": torch.cuda.device_count() if device == "cuda" else 0,
        "torch": torch.__version__,
        "args": vars(args),
        "runs": runs,
        "pinned_copy_gb_per_s": 0.0,
        "compare": {},
    }
    out = Path(args.out or f"bench/results/disagg-{result['date']}.json")
    with tempfile.TemporaryDirectory(prefix="dsg-", dir="/tmp") as workdir:
        for i, (topo, source) in enumerate(plan):
            run = measure(args, os.path.join(workdir, f"r{i}"), device, topo, source)
            runs.append(run)
            write_json(result, out)  # after every run, atomically: a cut stage keeps them
    moved = [r["transfer"]["bytes_per_prompt"] for r in runs if "transfer" in r]
    pinned = pinned_copy_gbps(max(moved), device) if moved else 0.0
    result.update(pinned_copy_gb_per_s=pinned, compare=compare(runs, pinned))
    write_json(result, out)
    report(result)
    print(f"-> {out}")
    return 0

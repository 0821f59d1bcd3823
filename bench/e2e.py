"""End-to-end decode benchmark (issue 5): baseline vs embedded vs service vs service-remote-swap
at an equal GPU KV budget, with the kv service and the engine as separate processes.

    python bench/e2e.py                 # GPU: contexts 32K and 128K, preset bench (< 10 min)
    python bench/e2e.py --smoke         # CPU: tiny preset and sizes, the whole harness (~1 min)
    python bench/e2e.py --row-formats bf16,fp8   # every run once per KV row format

Per context, each run starts `python -m engine_client serve` (and `python -m kv_service`, shared
by the service-mode runs of a context) on sockets in a temp dir, waits for grpc health, and
drives it with N concurrent decode.v1 Generate streams from worker processes. Every request is
a synthetic context (engine --synthetic-context: random KV, no prefill) + a short prompt.
Phases: batch1 (one stream), equal (baseline's max concurrency), max (the mode's own max in the
budget G; see bench/e2e_plan.py). Top-k: the replayed trace (bench/trace.py, calibrated to
published miss rates) in every mode, and the random model's own indexer (near-zero reuse).
Progress goes to stderr; JSON (+ PNG charts with matplotlib) to bench/results; a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import e2e_plan as plan  # noqa: E402
from bench.e2e_load import LoadGen, Sampler  # noqa: E402
from bench.e2e_report import charts, print_table, write_json  # noqa: E402
from bench.e2e_stats import analyze, ratios  # noqa: E402
from bench.roofline import analyze as roofline  # noqa: E402
from bench.row_formats import print_summary, probe_attention  # noqa: E402
from bench.trace import TraceParams, simulate  # noqa: E402
from engine_client.serve.procs import (  # noqa: E402
    REPO_ROOT,
    ManagedProcess,
    engine_process,
    segment_files,
    service_process,
)

SHM_DIR = "/dev/shm"
GIB = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset and sizes")
    ap.add_argument("--out", default="", help="JSON path [bench/results/e2e-<date>.json]")
    ap.add_argument("--contexts", default="", help="comma-separated [32768,131072; smoke 256]")
    ap.add_argument(
        "--gpu-kv-gib", type=float, default=None, help="GPU KV budget G [6; smoke 2 MiB]"
    )
    ap.add_argument("--hot-slots", type=int, default=None, help="B [4096; smoke 32]")
    ap.add_argument("--window", type=int, default=None, help="W [128; smoke 8]")
    ap.add_argument(
        "--steady-steps",
        type=int,
        default=None,
        help="decode steps at full concurrency per phase [128; smoke 8]",
    )
    ap.add_argument("--modes", default=",".join(plan.MODES))
    ap.add_argument("--sources", default="trace,indexer", help="top-k sources: trace, indexer")
    ap.add_argument("--no-sweep", action="store_true", help="skip the hit-rate-vs-B runs")
    ap.add_argument(
        "--client-procs", type=int, default=None, help="load worker processes [4; smoke 1]"
    )
    ap.add_argument(
        "--microbatches",
        type=int,
        default=2,
        help="embedded/service engines: decode parts whose miss copy overlaps compute "
        "[2, the engine's default; 1: off]",
    )
    ap.add_argument(
        "--admission-limit",
        default="auto",
        help="the engines' --admission-limit [auto: adaptive in the HiSparse modes; off: every "
        "mode admits up to its max N, as before the limit]",
    )
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
    return ap.parse_args(argv)


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
    )


def measure_ceilings() -> dict | None:
    """Pinned H2D copy etc. (bench/timing) in a child, so this process never holds a CUDA
    context or GPU memory beside the runs."""
    code = (
        "import json, torch; from bench.timing import measure_ceilings as m; "
        "c = m(); c['device'] = torch.cuda.get_device_name(); print(json.dumps(c))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
            ),
        },
    )
    if out.returncode != 0:
        print(f"ceilings failed: {out.stderr[-500:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Progress:
    """One live line on stderr (a line every few seconds when stderr is not a terminal)."""

    def __init__(self, total: int) -> None:
        self.total, self.t0, self.tty = total, time.monotonic(), sys.stderr.isatty()
        self._last = 0.0

    def line(self, i: int, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and not self.tty and now - self._last < 5:
            return
        self._last = now
        msg = f"[{i}/{self.total} {now - self.t0:5.0f}s] {text}"
        if self.tty:  # redraw in place; a forced line stays
            print("\r" + msg.ljust(110), file=sys.stderr, end="\n" if force else "", flush=True)
        else:
            print(msg, file=sys.stderr, flush=True)


class Children:
    """The kv service (kept while consecutive runs share its layout) and the current engine."""

    def __init__(self, sizes: plan.Sizes, workdir: str, instance: str, timeout: float) -> None:
        self.sizes, self.workdir, self.instance, self.timeout = sizes, workdir, instance, timeout
        self.service: ManagedProcess | None = None
        self.service_key: tuple | None = None
        self.metrics_port: int | None = None
        self.engine: ManagedProcess | None = None
        self.engine_metrics_port: int | None = None

    def service_for(self, run: plan.Run) -> ManagedProcess | None:
        key = (run.context, run.slots, run.hot_slots, run.max_context, run.draft_tokens)
        if run.mode not in ("service", "service-remote-swap"):
            self.stop_service()  # its host tier and GPU memory are not the next run's
            return None
        if self.service_key != key:
            self.stop_service()
            self.metrics_port = free_port()
            extra = [
                "--lease-seconds",
                "10",
                "--drain-timeout",
                "5",
                "--metrics-port",
                str(self.metrics_port),
                "--log-level",
                "WARNING",
            ]
            self.service = service_process(
                self.workdir,
                self.instance,
                plan.service_flags(self.sizes, run),
                device=self.sizes.device,
                shm_dir=SHM_DIR,
                extra=extra,
            )
            self.service.start().wait_serving(self.timeout)
            self.service_key = key
        return self.service

    def start_engine(self, run: plan.Run, name: str) -> ManagedProcess:
        uds = self.service.target.removeprefix("unix:") if run.mode.startswith("service") else ""
        # The engine's /metrics: step GPU time and GPU idle, next to the clients' ITL.
        self.engine_metrics_port = free_port()
        self.engine = engine_process(
            self.workdir,
            run.mode,
            service_uds=uds,
            name=name,
            extra=plan.engine_flags(self.sizes, run)
            + ["--metrics-port", str(self.engine_metrics_port)],
        )
        return self.engine.start().wait_serving(self.timeout)

    def stop_engine(self) -> int:
        code = 0
        if self.engine is not None:
            code = self.engine.stop()
            if code != 0:
                print(
                    f"\n{self.engine.name} exited with {code}:\n{self.engine.log()}",
                    file=sys.stderr,
                )
            self.engine = None
        return code

    def shm_bytes(self) -> int:
        return sum(
            os.path.getsize(os.path.join(SHM_DIR, n)) for n in segment_files(SHM_DIR, self.instance)
        )

    def stop_service(self) -> None:
        if self.service is not None:
            self.service.stop()
        self.service = self.service_key = self.metrics_port = None

    def close(self) -> list[str]:
        self.stop_engine()
        self.stop_service()
        left = segment_files(SHM_DIR, self.instance)
        for name in left:
            os.unlink(os.path.join(SHM_DIR, name))
        return left


async def run_phase(ctx: dict, run: plan.Run, phase: plan.Phase, i: int) -> dict:
    """One phase: `concurrency` streams at once, sampled, then analyzed."""
    ch, load, s = ctx["children"], ctx["load"], ctx["sizes"]
    pids = {"engine": ch.engine.pid, **({"service": ch.service.pid} if ch.service else {})}
    sampler = Sampler(
        ch.service.target if ch.service else None,
        ch.metrics_port,
        pids,
        engine_metrics_port=ch.engine_metrics_port,
    )
    sampler.start()
    task = asyncio.create_task(
        load.run(
            ch.engine.target,
            phase.concurrency,
            s.prompt_len,
            s.vocab,
            phase.new_tokens,
            ctx["stream_timeout"],
        )
    )
    total, t0 = phase.concurrency * phase.new_tokens, time.monotonic()
    while not task.done():
        ctx["progress"].line(
            i,
            f"{run.label} | {phase.name} N={phase.concurrency} | "
            f"{load.received}/{total} tokens | {time.monotonic() - t0:.1f}s",
        )
        await asyncio.wait([task], timeout=0.5)
    samples = await sampler.stop()
    if "records" in ctx:  # bench/mtp.py records the streams' tokens
        ctx["records"][run.label, phase.name] = task.result()
    return analyze(
        task.result(), samples, phase.concurrency, (ctx["ceilings"] or {}).get("h2d_gbs")
    )


async def run_one(ctx: dict, run: plan.Run, i: int) -> dict:
    ch, s = ctx["children"], ctx["sizes"]
    out = {
        "context": run.context,
        "mode": run.mode,
        "source": run.source,
        "tag": run.tag,
        "slots": run.slots,
        "hot_slots": run.hot_slots,
        "max_context": run.max_context,
        "engine_flags": plan.engine_flags(s, run),
        "phases": {},
    }
    t0 = time.monotonic()
    try:
        ctx["progress"].line(i, f"{run.label}: starting processes", force=True)
        if ch.service_for(run) is not None:
            out["service_flags"] = plan.service_flags(s, run)
            out["host_shm_bytes"] = ch.shm_bytes()
        ch.start_engine(run, f"engine{i}")
        out["startup_s"] = time.monotonic() - t0
        # Warm-up, not recorded: first-use costs (prefill kernels, allocator) stay out of batch1.
        await ctx["load"].run(ch.engine.target, 2, s.prompt_len, s.vocab, 4, ctx["stream_timeout"])
        for phase in run.phases:
            out["phases"][phase.name] = await run_phase(ctx, run, phase, i)
    except Exception as e:  # noqa: BLE001 - one broken run must not hide the others' numbers
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"\nrun {run.label} failed: {out['error']}", file=sys.stderr)
    finally:
        out["engine_exit"] = ch.stop_engine()
    out["run_s"] = time.monotonic() - t0
    p = out["phases"].get("max") or {}
    ctx["progress"].line(
        i,
        f"{run.label}: done in {out['run_s']:.0f}s"
        + (f", {p['tok_s']:.0f} tok/s at N={p['concurrency']}" if p.get("tok_s") else ""),
        force=True,
    )
    return out


async def run_all(ctx: dict, runs: list[plan.Run], budget: float | None) -> tuple[list, list]:
    results, skipped, longest = [], [], 0.0
    for i, run in enumerate(runs, 1):
        elapsed = time.monotonic() - ctx["t0"]
        if budget is not None and elapsed + longest > budget:
            skipped.append(run.label)
            continue
        results.append(await run_one(ctx, run, i))
        longest = max(longest, results[-1]["run_s"])
    return results, skipped


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

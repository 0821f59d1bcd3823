"""How bench.e2e runs its matrix: one run (its processes, a warm-up, its phases of concurrent
streams, each sampled and analyzed) after another, within a time budget; and the same run's
copy ceilings, measured in a child process."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from bench.e2e import plan, run_args
from bench.e2e.sampler import Sampler
from bench.e2e.stats import analyze
from bench.shared.child import run_python


def measure_ceilings() -> dict | None:
    """Pinned H2D copy etc. (bench.shared.timing) in a child, so this process never holds a
    CUDA context or GPU memory beside the runs."""
    code = (
        "import json, torch; from bench.shared.timing import measure_ceilings as m; "
        "c = m(); c['device'] = torch.cuda.get_device_name(); print(json.dumps(c))"
    )
    out = run_python(code, [], timeout=300)
    if out.returncode != 0:
        print(f"ceilings failed: {out.stderr[-500:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    if "records" in ctx:  # bench/mtp/cli.py records the streams' tokens
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
        "engine_flags": run_args.engine_flags(s, run),
        "phases": {},
    }
    t0 = time.monotonic()
    try:
        ctx["progress"].line(i, f"{run.label}: starting processes", force=True)
        if ch.service_for(run) is not None:
            out["service_flags"] = run_args.service_flags(s, run)
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

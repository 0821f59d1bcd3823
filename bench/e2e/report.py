"""Output of bench/e2e/cli.py: the final table, the PNG charts (when matplotlib is installed) and
the JSON file."""

from __future__ import annotations

from pathlib import Path

from bench.e2e.roofline import print_roofline
from bench.shared.trace import TARGET_MISS


def _f(v, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v * scale)


def print_table(payload: dict) -> None:
    _print_plans(payload)
    _print_phases(payload["runs"])
    _print_overlap(payload["runs"])
    for skipped in payload.get("skipped", []):
        print(f"  skipped (time budget): {skipped}")
    print("\nratios (same run; tok/s unless named)")
    for key, rs in payload["ratios"].items():
        print(f"  {key}: " + ", ".join(f"{k} {v:.2f}x" for k, v in rs.items()))
    print_roofline(payload)
    print(f"\nwall time {payload['wall_s']:.0f} s; JSON {payload['out']}")


def _print_plans(payload: dict) -> None:
    print(
        f"\nend-to-end decode, {payload['device']}, preset {payload['sizes']['preset']}, "
        f"GPU KV budget {payload['sizes']['gpu_kv_bytes'] / 2**30:.3g} GiB, "
        f"pinned H2D {_f((payload['ceilings'] or {}).get('h2d_gbs'))} GB/s"
    )
    for ctx, plan in payload["plans"].items():
        print(
            f"  context {ctx}: max requests baseline {plan['baseline']['max_requests']}, "
            f"HiSparse {plan['hisparse']['max_requests']} "
            f"({plan['capacity_ratio']:.2f}x), host tier "
            f"{plan['hisparse']['host_tier_bytes'] / 2**30:.2f} GiB"
        )


def _print_phases(runs: list[dict]) -> None:
    head = (
        f"{'context':>8} {'mode':<20} {'topk':<8} {'phase':<12} {'N':>4} {'tok/s':>9} "
        f"{'TTFT50':>8} {'TTFT99':>8} {'ITL50':>7} {'ITL99':>7} {'hit%':>6} "
        f"{'H2D GB/s':>9} {'%pin':>5} {'ctl%':>5} {'GPU GiB':>7} {'roof%':>5}  notes"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in runs:
        if r.get("error"):
            print(
                f"{r['context']:>8} {r['mode']:<20} {r['source']:<8} {'FAILED':<12} "
                f"{r['error'][:80]}"
            )
        for name, p in r.get("phases", {}).items():
            phase = name if r["tag"] == "main" else r["tag"]
            notes = "; ".join(p["errors"]) or ("" if p["steady"] else "no steady window")
            notes = "; ".join(filter(None, (_admitted(p), notes)))
            print(
                f"{r['context']:>8} {r['mode']:<20} {r['source']:<8} {phase:<12} "
                f"{p['concurrency']:>4} {_f(p['tok_s']):>9} {_f(p['ttft_p50_s'], 1e3):>8} "
                f"{_f(p['ttft_p99_s'], 1e3):>8} {_f(p['itl_p50_s'], 1e3, '{:.2f}'):>7} "
                f"{_f(p['itl_p99_s'], 1e3, '{:.2f}'):>7} {_f(p['hit_rate'], 100):>6} "
                f"{_f(p['h2d_gbs'], 1, '{:.2f}'):>9} "
                f"{_f(p['h2d_frac_of_pinned'], 100, '{:.0f}'):>5} "
                f"{_f(p.get('ctl_share'), 100, '{:.2f}'):>5} {_gpu_gib(p):>7} "
                f"{_f((p.get('roofline') or {}).get('achieved_over_limit'), 100, '{:.0f}'):>5}"
                f"  {notes[:60]}"
            )
    print(
        "TTFT: burst arrival (one prefill per step). ITL, tok/s, H2D: steady window at N. "
        "%pin: of the same run's pinned copy. ctl%: service time in Session messages and "
        "RemoteSwap calls / wall time. GPU GiB: engine + service (nvidia-smi). roof%: tok/s "
        "over the roofline limit without overlap (below), at the N that ran at once."
    )


def _print_overlap(runs: list[dict]) -> None:
    print(
        "\noverlap: client ITL p50 vs the engine's step GPU time in the same window "
        "(targets: <= 1.10x at max N, <= 1.05x at batch 1, GPU idle <= 5%)"
    )
    for r in runs:
        for name, p in r.get("phases", {}).items():
            if p.get("step_gpu_s") is not None:
                print(
                    f"  {r['context']:>8} {r['mode']:<20} {r['source']:<8} {name:<8} "
                    f"N={p['concurrency']:<4} ITL50 {_f(p['itl_p50_s'], 1e3, '{:.2f}')} ms, "
                    f"step {_f(p['step_gpu_s'], 1e3, '{:.2f}')} ms, "
                    f"{_f(p['itl_p50_over_step'], 1, '{:.2f}')}x, "
                    f"GPU idle {_f(p['gpu_idle_frac'], 100)}%, ITL99 "
                    f"{_f(p['itl_p99_s'], 1e3, '{:.1f}')} ms, GC {_f(p.get('gc_share'), 100)}% "
                    f"(longest {_f(p.get('gc_pause_max_s'), 1e3, '{:.1f}')} ms)"
                )


def _admitted(p: dict) -> str:
    """Where the engine's admission limit ran fewer streams at once than the phase started, or
    ended the phase below that."""
    n, running, limit = (
        p["concurrency"],
        p.get("running") or p["concurrency"],
        p.get("admission_limit"),
    )
    if running >= n and (limit is None or limit >= n):
        return ""
    return f"{running} at once, admission limit {_f(limit, 1, '{:.0f}')} at the end"


def _gpu_gib(p: dict) -> str:
    mib = [v for v in p.get("gpu_mib_peak", {}).values() if v]
    return f"{sum(mib) / 1024:.1f}" if mib else "-"


def hit_rate_points(payload: dict) -> list[dict]:
    """Measured hit rate by LRU capacity (B - W) / k: the sweep runs and the main HiSparse runs
    of the sweep's context (trace source)."""
    s = payload["sizes"]
    k, w = s["topk"], s["window"]
    ctx = s["contexts"][0]
    pts = []
    for r in payload["runs"]:
        if r["context"] != ctx or r["source"] != "trace" or r["mode"] == "baseline":
            continue
        for name, p in r.get("phases", {}).items():
            if p["hit_rate"] is not None and name in ("sweep", "max"):
                pts.append(
                    {
                        "hot_slots": r["hot_slots"],
                        "lru_over_k": (r["hot_slots"] - w) / k,
                        "mode": r["mode"],
                        "hit_rate": p["hit_rate"],
                    }
                )
    return sorted(pts, key=lambda p: p["lru_over_k"])


def charts(payload: dict, out_json: Path) -> list[str]:
    """PNG files written next to the JSON; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    stem = out_json.with_suffix("")
    files = [
        _throughput_chart(plt, payload, Path(f"{stem}-throughput.png")),
        _hit_rate_chart(plt, payload, Path(f"{stem}-hitrate.png")),
    ]
    return [str(f) for f in files if f is not None]


def _throughput_chart(plt, payload: dict, path: Path) -> Path | None:
    ctxs = payload["sizes"]["contexts"]
    fig, axes = plt.subplots(1, len(ctxs), figsize=(6 * len(ctxs), 4.5), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs):
        for r in payload["runs"]:
            if r["context"] != ctx or r["source"] != "trace" or r["tag"] != "main":
                continue
            phases = sorted(r.get("phases", {}).values(), key=lambda p: p["concurrency"])
            pts = [(p["concurrency"], p["tok_s"]) for p in phases if p["tok_s"]]
            if pts:
                (line,) = ax.plot(*zip(*pts), marker="o", label=r["mode"])
                _roofline_curve(ax, phases, line.get_color(), r["mode"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"context {ctx}, equal GPU KV budget (trace top-k)")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(plt, fig, path)


def _roofline_curve(ax, phases: list[dict], color: str, mode: str) -> None:
    """The mode's roofline limit (no overlap) at its measured N, dashed in its colour."""
    lim = [(p["concurrency"], p["roofline"]["limit_tok_s"]) for p in phases if p.get("roofline")]
    if lim:
        ax.plot(
            *zip(*lim), linestyle="--", marker="x", color=color, alpha=0.6, label=f"{mode} roofline"
        )


def _hit_rate_chart(plt, payload: dict, path: Path) -> Path | None:
    pts = hit_rate_points(payload)
    sim = payload.get("trace_simulated") or {}
    if not pts and not sim:
        return None
    fig, ax = plt.subplots(figsize=(6, 4.5))
    if pts:
        ax.plot(
            [p["lru_over_k"] for p in pts],
            [p["hit_rate"] for p in pts],
            "o-",
            label="measured (engine)",
        )
    for key, style, label in (
        ("trace_simulated", "s--", "trace, simulated LRU (steady)"),
        ("trace_simulated_request_life", "d--", "trace, simulated over one sweep request"),
    ):
        curve = payload.get(key) or {}
        xs = sorted(curve, key=float)
        if xs:
            ax.plot([float(x) for x in xs], [1 - curve[x] for x in xs], style, label=label)
    ax.plot(
        list(TARGET_MISS), [1 - m for m in TARGET_MISS.values()], "x:", label="published (k=2048)"
    )
    ax.set_xlabel("LRU capacity (B - W) / k")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

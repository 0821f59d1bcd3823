"""Numbers of one phase of bench/e2e/cli.py, from the streams' records and the sampler's samples.

Steady window: all N streams start at once, the engine prefills one request per step, so the
batch ramps up for N steps; every request then decodes the same number of tokens, so the first
one to finish leaves after steady_steps steps at full concurrency. The window runs from the
last stream's first token to the first stream's last token: throughput, ITL, service-side hit
rate, PCIe traffic and control-plane share are taken there. TTFT is over all streams (burst
arrival: it includes queueing behind the other prefills).

When the engine's admission limit (engine_client/loop/admission_limit.py) runs fewer than N at
once, the rest wait until the first streams end: the window is then that of the first wave, the
streams whose first token came before any stream ended (`running` of them, all decoding and
nothing else until the first one ends), and `admission_limit` is the limit the engine showed
last in the phase.
"""

from __future__ import annotations

import statistics


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def steady_window(recs: list[dict]) -> tuple[float, float, bool, int]:
    """(start, end, steady, running): the first wave of `running` streams (all of them when the
    engine ran them at once) decoding between start and end, and no other stream."""
    firsts = [r["arrivals"][0] for r in recs if r["arrivals"]]
    lasts = [r["arrivals"][-1] for r in recs if r["arrivals"]]
    if len(recs) > 1 and len(firsts) == len(recs):
        wave = [f for f in firsts if f < min(lasts)]
        if len(wave) > 1:
            return max(wave), min(lasts), True, len(wave)
    whole = (min(firsts), max(lasts), len(recs) == 1, len(recs)) if firsts else None
    return whole or (0.0, 0.0, False, 0)


def _in_window(samples: list[dict], key: str, a: float, b: float) -> tuple[dict, dict] | None:
    """First and last sample inside [a, b] that carry `key`."""
    inside = [s for s in samples if key in s and a <= s["t"] <= b]
    return (
        (inside[0], inside[-1]) if len(inside) >= 2 and inside[-1]["t"] > inside[0]["t"] else None
    )


def _service_window(samples: list[dict], a: float, b: float, itl: float | None) -> dict:
    out: dict = {}
    kv = _in_window(samples, "kv", a, b)
    if kv:
        d = {k: kv[1]["kv"][k] - kv[0]["kv"][k] for k in ("hits", "misses", "bytes_moved")}
        dt = kv[1]["t"] - kv[0]["t"]
        sel = d["hits"] + d["misses"]
        out["window_hit_rate"] = d["hits"] / sel if sel else None
        out["window_h2d_gbs"] = d["bytes_moved"] / dt / 1e9
    rpc = _in_window(samples, "rpc", a, b)
    if rpc:
        dt = rpc[1]["t"] - rpc[0]["t"]
        s0, s1 = rpc[0]["rpc"], rpc[1]["rpc"]
        secs = sum(v[0] - s0.get(m, [0.0, 0.0])[0] for m, v in s1.items())
        msgs = sum(v[1] - s0.get(m, [0.0, 0.0])[1] for m, v in s1.items())
        out["ctl_share"] = secs / dt
        out["ctl_us_per_msg"] = 1e6 * secs / msgs if msgs else None
        out["ctl_msgs_per_step"] = msgs / (dt / itl) if itl else None
    return out


def _engine_window(samples: list[dict], a: float, b: float, itl_p50: float | None) -> dict:
    """The engine's own view of the window: mean step GPU time (the graphed step at this N),
    GPU idle between back-to-back steps, and the clients' ITL p50 over that step time."""
    eng, span = _in_window(samples, "engine", a, b), "window"
    if not eng:  # a window shorter than two samples (CPU smoke runs): the whole phase
        eng, span = _in_window(samples, "engine", float("-inf"), float("inf")), "phase"
    if not eng:
        return {}
    d = {k: eng[1]["engine"].get(k, 0.0) - eng[0]["engine"].get(k, 0.0) for k in eng[1]["engine"]}
    steps = d.get("engine_step_device_seconds_count", 0.0)
    step = d.get("engine_step_device_seconds_sum", 0.0) / steps if steps else None
    busy, idle = (
        d.get("engine_device_busy_seconds_total", 0.0),
        d.get("engine_device_idle_seconds_total", 0.0),
    )
    drafted = d.get("engine_spec_drafted_tokens_total", 0.0)
    return {
        "engine_span": span,
        "step_gpu_s": step,
        "gpu_idle_frac": idle / (busy + idle) if busy + idle else None,
        "itl_p50_over_step": itl_p50 / step if itl_p50 is not None and step else None,
        # Speculative steps: drafts per step and their acceptance; swap misses per step, as
        # copied (the verify rows share one plan) and summed over the rows.
        "drafted_per_step": drafted / steps if steps else None,
        "acceptance": d.get("engine_spec_accepted_tokens_total", 0.0) / drafted
        if drafted
        else None,
        "misses_per_step": d.get("engine_swap_misses_total", 0.0) / steps if steps else None,
        "misses_rows_per_step": d.get("engine_swap_misses_rows_total", 0.0) / steps
        if steps
        else None,
        **_gc(eng, d),
    }


def _gc(eng: tuple[dict, dict], d: dict) -> dict:
    """The engine's garbage collections in the window (transport/gc_heap.py): their share of the
    wall time, the full ones, and the longest pause since the engine started."""
    dt = eng[1]["t"] - eng[0]["t"]
    return {
        "gc_share": d.get("engine_gc_seconds_total", 0.0) / dt if dt > 0 else None,
        "gc_full_collections": d.get("engine_gc_full_collections_total"),
        "gc_pause_max_s": eng[1]["engine"].get("engine_gc_pause_max_seconds"),
    }


def _admission(samples: list[dict]) -> dict:
    """The engine's admission limit at the phase's end, and its batch of best throughput."""
    last = next((s["engine"] for s in reversed(samples) if "engine" in s), {})
    return {
        "admission_limit": last.get("engine_admission_limit"),
        "admission_best_batch": last.get("engine_admission_best_batch"),
    }


def _peaks(samples: list[dict], key: str) -> dict:
    peak: dict = {}
    for s in samples:
        for name, v in s.get(key, {}).items():
            if v is not None:
                peak[name] = max(peak.get(name, 0), v)
    return peak


def _itls_and_rate(
    recs: list[dict], a: float, b: float, steady: bool
) -> tuple[list[float], float | None]:
    """The token gaps in the window [a, b] and the phase's tokens per second."""
    # Only token gaps wholly inside the window: the gap that spans the last prefill step
    # belongs to the ramp. Throughput = sum of the streams' token rates in the window.
    gaps = [
        [y - x for x, y in zip(r["arrivals"], r["arrivals"][1:]) if a <= x and y <= b] for r in recs
    ]
    tok_s = sum(len(gs) / sum(gs) for gs in gaps if gs and sum(gs) > 0) if steady else None
    if not steady and b > a:
        tok_s = sum(1 for r in recs for t in r["arrivals"] if a < t <= b) / (b - a)
    return [g for gs in gaps for g in gs], tok_s


def _h2d(moved: int, tokens: int, tok_s: float | None, ceiling_gbs: float | None) -> dict:
    # Bytes per token are about the same at every step of the phase, so bytes/token x the
    # window's token rate is the window's PCIe traffic in every mode (embedded has no sampler).
    gbs = moved / tokens * tok_s / 1e9 if tokens and tok_s else None
    frac = gbs / ceiling_gbs if gbs is not None and ceiling_gbs else None
    return {"h2d_gbs": gbs, "h2d_frac_of_pinned": frac}


def analyze(
    recs: list[dict], samples: list[dict], concurrency: int, h2d_ceiling_gbs: float | None
) -> dict:
    """Every number of one phase (seconds in s, rates per s; None where not measurable)."""
    a, b, steady, running = steady_window(recs)
    itls, tok_s = _itls_and_rate(recs, a, b, steady)
    in_win = len(itls)
    ttfts = [r["arrivals"][0] - r["submitted"] for r in recs if r["arrivals"]]
    tokens = sum(len(r["arrivals"]) for r in recs)
    hits, misses = sum(r["hits"] for r in recs), sum(r["misses"] for r in recs)
    moved = sum(r["bytes_moved"] for r in recs)
    itl_mean = statistics.fmean(itls) if itls else None
    out = {
        "concurrency": concurrency,
        "running": running,
        "streams_ok": sum(1 for r in recs if r["finish"] == "LENGTH"),
        "errors": sorted({r["error"] for r in recs if r["error"]})[:5],
        "tokens": tokens,
        "steady": steady,
        "window_s": b - a,
        "tokens_in_window": in_win,
        "tok_s": tok_s,
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "itl_p50_s": _pct(itls, 0.5),
        "itl_p99_s": _pct(itls, 0.99),
        "itl_mean_s": itl_mean,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "bytes_moved": moved,
    }
    out.update(_h2d(moved, tokens, tok_s, h2d_ceiling_gbs))
    out.update(_service_window(samples, a, b, itl_mean))
    out.update(_engine_window(samples, a, b, out["itl_p50_s"]))
    out.update(_admission(samples))
    out["gpu_mib_peak"] = _peaks(samples, "gpu_mib")
    out["rss_bytes_peak"] = _peaks(samples, "rss")
    return out


def _get(results: list[dict], ctx: int, mode: str, source: str, phase: str, key: str):
    for r in results:
        if (r["context"], r["mode"], r["source"], r["tag"]) == (ctx, mode, source, "main"):
            return r["phases"].get(phase, {}).get(key)
    return None


def _ratio(x, y) -> float | None:
    return x / y if x is not None and y else None


def ratios(results: list[dict], contexts: list[int], sources: list[str]) -> dict:
    """Same-run ratios per context and top-k source (tok/s unless named)."""
    out: dict = {}
    for ctx in contexts:
        for src in sources:
            t = lambda mode, ph: _get(results, ctx, mode, src, ph, "tok_s")  # noqa: E731
            r = {
                "service/baseline at max": _ratio(t("service", "max"), t("baseline", "max")),
                "service/baseline at equal": _ratio(t("service", "equal"), t("baseline", "max")),
                "batch-1 service/baseline": _ratio(t("service", "batch1"), t("baseline", "batch1")),
                "service/embedded at max": _ratio(t("service", "max"), t("embedded", "max")),
                "service/embedded at equal": _ratio(t("service", "equal"), t("embedded", "equal")),
                "remote-swap/service at equal": _ratio(
                    t("service-remote-swap", "equal"), t("service", "equal")
                ),
                "max concurrency service/baseline": _ratio(
                    _get(results, ctx, "service", src, "max", "concurrency"),
                    _get(results, ctx, "baseline", src, "max", "concurrency"),
                ),
            }
            r = {k: v for k, v in r.items() if v is not None}
            if r:
                out[f"{ctx} {src}"] = r
    return out

"""Numbers and table of bench/mtp/cli.py: per (context, mode) the plain run against the speculative
run (drafts: the BENCHMARK-ONLY replay of the plain run's tokens)."""

from __future__ import annotations

from bench.e2e.stats import steady_window


def window_tok_s(recs: list[dict]) -> float | None:
    """Tokens arriving in the steady window / its length. With speculation tokens arrive in
    bursts of up to D + 1, so e2e's per-stream gap rate would overstate; this counts them, the
    same way for both runs."""
    a, b, _, _ = steady_window(recs)
    if b <= a:
        return None
    return sum(1 for r in recs for t in r["arrivals"] if a < t <= b) / (b - a)


def summary(pair: dict) -> dict:
    """The numbers the issue asks for, of one (context, mode)."""
    if pair.get("skipped"):
        return {}
    a, b = pair["plain"]["phases"], pair["mtp"]["phases"]
    g = lambda runs, ph, k: (runs.get(ph) or {}).get(k)  # noqa: E731
    ratio = lambda x, y: x / y if x is not None and y else None  # noqa: E731
    return {
        "N": g(b, "max", "concurrency"),
        "same_tokens": pair.get("same_tokens"),
        "tok_s": g(a, "max", "window_tok_s"),
        "tok_s_mtp": g(b, "max", "window_tok_s"),
        "tok_s_ratio": ratio(g(b, "max", "window_tok_s"), g(a, "max", "window_tok_s")),
        "batch1_itl_mean_s": g(a, "batch1", "itl_mean_s"),
        "batch1_itl_mean_s_mtp": g(b, "batch1", "itl_mean_s"),
        "acceptance": g(b, "max", "acceptance"),
        "drafted_per_step": g(b, "max", "drafted_per_step"),
        "misses_per_step": g(a, "max", "misses_per_step"),
        "misses_per_step_mtp": g(b, "max", "misses_per_step"),
        "misses_rows_per_step_mtp": g(b, "max", "misses_rows_per_step"),
    }


def print_table(payload: dict) -> None:
    f = lambda v, s=1.0, fmt="{:.1f}": "-" if v is None else fmt.format(v * s)  # noqa: E731
    print(
        f"\nMTP vs plain decoding, {payload['device']}, preset {payload['sizes']['preset']}, "
        f"{payload['sizes']['row_format']} rows, D = {payload['draft_tokens']}, drafts: "
        "BENCHMARK-ONLY replay of the plain run's tokens; speculative steps wait for each "
        f"step, plain runs {'overlap' if payload['plain_overlap'] else 'wait for every step'}"
    )
    head = (
        f"{'context':>8} {'mode':<9} {'N':>4} {'tok/s':>9} {'mtp':>9} {'x':>5} "
        f"{'ITL1 ms':>8} {'mtp':>8} {'accept%':>7} {'drafts':>6} {'miss/st':>8} "
        f"{'mtp':>8} {'rows':>8} {'same%':>5}"
    )
    print(head + "\n" + "-" * len(head))
    for pair in payload["pairs"]:
        s = summary(pair)
        if not s:
            print(f"{pair['context']:>8} {pair['mode']:<9} skipped (time budget)")
            continue
        print(
            f"{pair['context']:>8} {pair['mode']:<9} {s['N'] or 0:>4} {f(s['tok_s']):>9} "
            f"{f(s['tok_s_mtp']):>9} {f(s['tok_s_ratio'], 1, '{:.2f}'):>5} "
            f"{f(s['batch1_itl_mean_s'], 1e3, '{:.2f}'):>8} "
            f"{f(s['batch1_itl_mean_s_mtp'], 1e3, '{:.2f}'):>8} "
            f"{f(s['acceptance'], 100):>7} {f(s['drafted_per_step']):>6} "
            f"{f(s['misses_per_step']):>8} {f(s['misses_per_step_mtp']):>8} "
            f"{f(s['misses_rows_per_step_mtp']):>8} {f(s['same_tokens'], 100, '{:.0f}'):>5}"
        )
    print(
        "tok/s at max N (same N both ways); ITL1: batch-1 mean gap; miss/st: swap misses per "
        "engine step: plain, MTP as copied (rows share one plan), MTP summed over rows; same%: "
        "MTP streams whose tokens equal the plain run's."
    )

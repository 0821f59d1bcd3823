"""Misses per token of speculative verify steps on the trace (issue 41), by the plan's exact LRU
over one (layer, request), on CPU: what a verify step's union of D + 1 rows' selections costs
in copies per emitted token, against plain decoding at the same LRU capacity.

    python -m bench.shared.verify_misses [--capacities 4096,6144] [--drafts 1,2]
        [--acceptance 0.9,0.75,0.6]

A verify step at position p selects for rows p .. p + D (each row's top-k from the trace), swaps
in their union (the engine's union plan: one LRU update with the distinct positions), and moves
on by 1 + a tokens, a the accepted drafts drawn at the conditional rates (the BENCHMARK-ONLY
synthetic rule's model, seeded). Plain decoding is D = 0. The engine's own counts (bench.mtp's
"misses per step") also carry the MTP layer's selections, a KV layer plain decoding does not
have: with L decoder layers a speculative run copies for L + 1 layers, so its misses per token
are (L + 1) / L those of a single layer here.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from bench.shared.trace import TraceParams, lru_update, selector


def misses_per_token(
    capacity: int,
    draft_tokens: int,
    rates: tuple[float, ...],
    k: int = 2048,
    context: int = 32768,
    window: int = 128,
    steps: int = 400,
    warmup: int = 60,
    seed: int = 0,
) -> float:
    """Steady-state misses per emitted token of one (layer 0, slot 0) at LRU `capacity`
    (B - W) with verify steps of `draft_tokens` drafts accepted at `rates` (per position,
    conditional; the last repeats)."""
    trace, rng = selector(TraceParams(), k), np.random.default_rng(seed)

    def select(seq_len: int) -> np.ndarray:
        x = trace(seq_len)
        return x[(x >= 0) & (x < seq_len - window)]

    order = np.full(capacity, -1, dtype=np.int64)
    pos, missed, tokens = context, 0, 0
    for step in range(steps):
        rows = [select(pos + j + 1) for j in range(draft_tokens + 1)]
        order, misses = lru_update(order, np.unique(np.concatenate(rows)))
        accepted = 0
        while accepted < draft_tokens and rng.random() < rates[min(accepted, len(rates) - 1)]:
            accepted += 1
        if step >= warmup:
            missed, tokens = missed + misses, tokens + accepted + 1
        pos += accepted + 1
    return missed / tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--capacities", default="4096,6144", help="LRU slots (B - W), comma-separated")
    ap.add_argument("--drafts", default="1,2", help="D values besides plain decoding (0)")
    ap.add_argument("--acceptance", default="0.9,0.75,0.6", help="conditional rates per draft")
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args(argv)
    rates = tuple(float(r) for r in args.acceptance.split(","))
    table = {}
    for cap in (int(c) for c in args.capacities.split(",")):
        for d in (0, *(int(x) for x in args.drafts.split(","))):
            if 2048 * (d + 1) > cap:
                continue  # the union would not fit: the layout refuses this D
            table[f"{cap}/D{d}"] = round(misses_per_token(cap, d, rates, steps=args.steps), 1)
    print(json.dumps({"acceptance": rates, "misses_per_token": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

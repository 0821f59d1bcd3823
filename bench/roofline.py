"""Roofline of the end-to-end decode benchmark (issue 16), from the same run's measured ceilings.

    python bench/roofline.py bench/results/e2e-<date>.json    # the table of an e2e JSON

A decode step of N requests over L layers costs at least

    step(N) = fixed + N * L * (HBM bytes / HBM BW + miss bytes / PCIe BW)       (serial)
    step(N) = fixed + N * L * max(HBM bytes / HBM BW, miss bytes / PCIe BW)     (copy overlapped)

per request-layer: the indexer reads every index key of the context, writes an fp32 score per
token that top-k reads back, attention reads the k selected rows, and in HiSparse modes each
missed row crosses PCIe once and is written into the hot buffer. Row and key bytes come from
the layout (1152 B bf16 / 656 B fp8 rows, 256 B bf16 / 132 B fp8 keys); top-k ids and slot
lists (a few KB) are left out. Ceilings: pinned host->device copy (PCIe) and device->device
copy counting bytes read + written (HBM), both measured in the run. The fixed cost (weights,
launches, host work per step) comes from the batch-1 phases: step(1) minus one request's
traffic, the smallest over the context's modes. Limit tok/s = N / step(N); the report gives
achieved / limit and the share of each term in the limit step.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.layout import INDEX_FORMATS, ROW_FORMATS  # noqa: E402

SCORE_BYTES = 4  # fp32 indexer score per context token
HISPARSE = ("embedded", "service", "service-remote-swap")


@dataclass(frozen=True)
class Ceilings:
    """GB/s: pinned host->device copy, and device->device copy (bytes read + written)."""

    h2d_gbs: float
    hbm_gbs: float

    @classmethod
    def from_measured(cls, ceil: dict | None) -> "Ceilings | None":
        if not ceil or not ceil.get("h2d_gbs") or not ceil.get("d2d_gbs"):
            return None
        return cls(ceil["h2d_gbs"], ceil["d2d_gbs"])


@dataclass(frozen=True)
class Traffic:
    """Bytes one request moves for one layer of one decode step."""

    index: float  # index keys read by the indexer
    scores: float  # fp32 scores written by the indexer and read by top-k
    attention: float  # selected rows read by attention
    miss_write: float  # missed rows written into the hot buffer
    pcie: float  # missed rows read from the host tier

    @property
    def hbm(self) -> float:
        return self.index + self.scores + self.attention + self.miss_write

    def seconds(self, ceil: Ceilings) -> tuple[float, float]:
        """(HBM seconds, PCIe seconds)."""
        return self.hbm / (ceil.hbm_gbs * 1e9), self.pcie / (ceil.h2d_gbs * 1e9)


def request_layer_traffic(
    context: int, topk: int, row_bytes: int, index_bytes: int, miss_rate: float
) -> Traffic:
    """Traffic of one request-layer at `context` tokens; miss_rate of the k selected rows."""
    k = min(topk, context)
    misses = miss_rate * k * row_bytes
    return Traffic(
        index=context * index_bytes,
        scores=2 * SCORE_BYTES * context,
        attention=k * row_bytes,
        miss_write=misses,
        pcie=misses,
    )


def per_request_layer_s(t: Traffic, ceil: Ceilings, overlap: bool) -> float:
    hbm, pcie = t.seconds(ceil)
    return max(hbm, pcie) if overlap else hbm + pcie


def fixed_cost_s(step1_s: float, t1: Traffic, ceil: Ceilings, num_layers: int) -> float:
    """Fixed step cost from a measured batch-1 step (serial model: nothing overlapped there)."""
    return max(0.0, step1_s - num_layers * per_request_layer_s(t1, ceil, overlap=False))


def step_limit_s(
    n: int, num_layers: int, fixed_s: float, t: Traffic, ceil: Ceilings, overlap: bool
) -> float:
    return fixed_s + n * num_layers * per_request_layer_s(t, ceil, overlap)


def limit_tok_s(
    n: int, num_layers: int, fixed_s: float, t: Traffic, ceil: Ceilings, overlap: bool
) -> float:
    return n / step_limit_s(n, num_layers, fixed_s, t, ceil, overlap)


@dataclass(frozen=True)
class Shape:
    """What the model needs from the benchmark's sizes."""

    num_layers: int
    topk: int
    row_bytes: int
    index_bytes: int
    extra_tokens: int = 0  # prompt tokens on top of the synthetic context

    @classmethod
    def from_sizes(cls, s: dict) -> "Shape":
        return cls(
            s["num_layers"],
            s["topk"],
            ROW_FORMATS[s.get("row_format", "bf16")].row_bytes,
            INDEX_FORMATS[s.get("index_format", "fp8")].key_bytes,
            s.get("prompt_len", 0),
        )

    def traffic(self, context: int, mode: str, hit_rate: float | None) -> Traffic:
        miss = (1.0 - hit_rate) if mode in HISPARSE and hit_rate is not None else 0.0
        return request_layer_traffic(
            context + self.extra_tokens, self.topk, self.row_bytes, self.index_bytes, miss
        )


def point(
    shape: Shape, ceil: Ceilings, fixed_s: float, n: int, t: Traffic, achieved_tok_s: float | None
) -> dict:
    """Limit and achieved/limit at n requests, serial and overlapped, with the terms' shares."""
    L = shape.num_layers
    hbm, pcie = t.seconds(ceil)
    serial = step_limit_s(n, L, fixed_s, t, ceil, overlap=False)
    over = step_limit_s(n, L, fixed_s, t, ceil, overlap=True)
    out = {
        "n": n,
        "miss_rate": t.pcie / max(t.attention, 1.0),
        "hbm_bytes": t.hbm,
        "pcie_bytes": t.pcie,
        "fixed_ms": 1e3 * fixed_s,
        "step_limit_ms": 1e3 * serial,
        "step_limit_overlap_ms": 1e3 * over,
        "limit_tok_s": n / serial,
        "limit_tok_s_overlap": n / over,
        "share": {
            "fixed": fixed_s / serial,
            "hbm": n * L * hbm / serial,
            "pcie": n * L * pcie / serial,
        },
        "achieved_tok_s": achieved_tok_s,
    }
    if achieved_tok_s:
        out["achieved_over_limit"] = achieved_tok_s * serial / n
        out["achieved_over_limit_overlap"] = achieved_tok_s * over / n
    return out


def _main_runs(payload: dict, ctx: int) -> list[dict]:
    return [r for r in payload["runs"] if r["context"] == ctx and r["tag"] == "main"]


def context_fixed_s(payload: dict, shape: Shape, ceil: Ceilings, ctx: int) -> dict[str, float]:
    """Fixed cost per mode from its batch-1 phase (trace top-k) at context ctx."""
    out = {}
    for r in _main_runs(payload, ctx):
        p = r["phases"].get("batch1")
        if r["source"] == "trace" and p and p.get("tok_s"):
            t1 = shape.traffic(ctx, r["mode"], p.get("hit_rate"))
            out[r["mode"]] = fixed_cost_s(1.0 / p["tok_s"], t1, ceil, shape.num_layers)
    return out


def analyze(payload: dict) -> dict:
    """The roofline of an e2e payload: per context the fixed cost and the limit ratios, and
    a "roofline" dict added to every measured phase. {} without both ceilings."""
    ceil = Ceilings.from_measured(payload.get("ceilings"))
    if ceil is None:
        return {"skipped": "no pinned-copy and device-copy ceilings in this run"}
    shape = Shape.from_sizes(payload["sizes"])
    out: dict = {"ceilings": asdict(ceil), "shape": asdict(shape), "contexts": {}}
    for ctx in payload["sizes"]["contexts"]:
        by_mode = context_fixed_s(payload, shape, ceil, ctx)
        if not by_mode:
            continue
        fixed = min(by_mode.values())
        for r in _main_runs(payload, ctx):
            for p in r["phases"].values():
                n = p.get("running") or p.get("concurrency")  # running: under an admission limit
                if n:
                    t = shape.traffic(ctx, r["mode"], p.get("hit_rate"))
                    p["roofline"] = point(shape, ceil, fixed, n, t, p.get("tok_s"))
        out["contexts"][str(ctx)] = {
            "fixed_ms": 1e3 * fixed,
            "fixed_ms_by_mode": {m: 1e3 * v for m, v in by_mode.items()},
            "ratios": limit_ratios(payload, ctx),
        }
    return out


def _phase(payload: dict, ctx: int, mode: str, phase: str) -> dict | None:
    for r in _main_runs(payload, ctx):
        if r["mode"] == mode and r["source"] == "trace":
            return r["phases"].get(phase)
    return None


def limit_ratios(payload: dict, ctx: int) -> dict:
    """service/baseline tok/s at each mode's max N: the limit's (serial, overlapped) and the
    achieved one, for the ratio targets that move with the roofline."""
    s, b = _phase(payload, ctx, "service", "max"), _phase(payload, ctx, "baseline", "max")
    if not (s and b and s.get("roofline") and b.get("roofline")):
        return {}
    rs, rb = s["roofline"], b["roofline"]
    out = {
        "service/baseline at max, limit": rs["limit_tok_s"] / rb["limit_tok_s"],
        "service/baseline at max, limit overlapped": rs["limit_tok_s_overlap"]
        / rb["limit_tok_s_overlap"],
    }
    if s.get("tok_s") and b.get("tok_s"):
        out["service/baseline at max, achieved"] = s["tok_s"] / b["tok_s"]
    return out


def print_roofline(payload: dict) -> None:
    roof = payload.get("roofline") or {}
    if "contexts" not in roof:
        print(f"\nroofline: {roof.get('skipped', 'not computed')}")
        return
    c = roof["ceilings"]
    print(
        f"\nroofline (pinned H2D {c['h2d_gbs']:.1f} GB/s, HBM {c['hbm_gbs']:.0f} GB/s, same run; "
        f"fixed cost from batch 1)"
    )
    print(
        f"{'context':>8} {'mode':<20} {'phase':<7} {'N':>4} {'miss%':>6} {'tok/s':>8} "
        f"{'limit':>8} {'ach/lim':>7} {'lim ovl':>8} {'ach/ovl':>7}  fixed/HBM/PCIe share"
    )
    for r in payload["runs"]:
        for name, p in r.get("phases", {}).items():
            q = p.get("roofline")
            if not q or r["tag"] != "main":
                continue
            sh = q["share"]
            mode = r["mode"] + ("" if r["source"] == "trace" else " " + r["source"])
            print(
                f"{r['context']:>8} {mode:<20} "
                f"{name:<7} {q['n']:>4} {100 * q['miss_rate']:>6.1f} {_num(q['achieved_tok_s'])} "
                f"{q['limit_tok_s']:>8.0f} {_num(q.get('achieved_over_limit'), 7, 2)} "
                f"{q['limit_tok_s_overlap']:>8.0f} "
                f"{_num(q.get('achieved_over_limit_overlap'), 7, 2)}"
                f"  {sh['fixed']:.2f}/{sh['hbm']:.2f}/{sh['pcie']:.2f}"
            )
    for ctx, v in roof["contexts"].items():
        mode_fixed = ", ".join(f"{m} {ms:.2f}" for m, ms in v["fixed_ms_by_mode"].items())
        print(
            f"  {ctx}: fixed {v['fixed_ms']:.2f} ms (by mode: {mode_fixed}); "
            + ", ".join(f"{k} {x:.2f}x" for k, x in v["ratios"].items())
        )


def _num(v: float | None, width: int = 8, digits: int = 0) -> str:
    return "-".rjust(width) if v is None else f"{v:>{width}.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("json", help="an e2e JSON (bench/e2e.py --out)")
    ap.add_argument("--write", action="store_true", help="store the roofline into the JSON")
    args = ap.parse_args(argv)
    payload = json.loads(Path(args.json).read_text())
    payload["roofline"] = analyze(payload)
    print_roofline(payload)
    if args.write:
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

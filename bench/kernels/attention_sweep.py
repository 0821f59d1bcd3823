"""Sweep of the two-pass sparse MLA decode (kernels/attention/two_pass.py) against the fused
kernel, per row format and batch size, at V3.2's decode shape (H 128, k 2048, B 4096).

    python -m bench.kernels.attention_sweep [--batches 8,32,64,128,256] [--quick] [--out PATH]

The score and mix passes are timed apart (CUDA graphs, one variant at a time), for every
launch variant of each; per tile size (BLOCK_T, which fixes the bits) the best score plus the
best mix is then timed together and checked: against the fp64 reference at a small batch, and
bit for bit against every other launch of the same tile size. Prints a table and the proposed
kernels/attention/configs.py entries; writes JSON. Rooflines: per request-layer 570 MFLOP
(2 * 128 * 2048 * 1088) over the same run's bf16 matmul rate, and the KV bytes over HBM.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.shared.timing import graph_time_us, measure_ceilings
from kernels.attention.configs import LaunchConfig
from kernels.attention.sparse import (
    AttnWorkspace,
    TileWorkspace,
    mix_pass,
    score_pass,
    sparse_mla_decode,
)
from kernels.formats import ROW_FORMATS
from kernels.reference import ref_sparse_mla_decode
from kernels.store.fp8_row import kv_quantize

H, K, B, SCALE = 128, 2048, 4096, 576**-0.5
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA:  # CPU smoke run (Triton's interpreter): the same code on tiny shapes
    H, K, B = 16, 96, 160
FLOP = 2 * H * K * (576 + 512)
# (BLOCK_T, score stages) per row format; all 128 heads per program on 8 warps unless --heads
# asks for fewer (the tensor cores sum each score in one order for any M, so the launch table
# may mix these without changing bits; check() compares). Run D also timed
# a register prefetch of the next K tile (slower at every shape; removed). It is back as
# LaunchConfig.score_prefetch, flat over the chunk's tiles with each tile's slots loaded where
# they are used (12 barriers a tile instead of 27 in the fp8 SASS, 250 registers, no spills):
# timed beside the plain loop for 128-head programs.
# (32, 1): 64 heads' Q and one 32-row tile fit twice in an SM's shared memory (--heads 64).
SCORE = {"bf16": [(64, 1), (32, 2)], "fp8": [(64, 1), (32, 3), (32, 1)]}
CHUNKS = (64, 128, 256, 512, 1024, 2048) if CUDA else (32, 64)
# (mix columns, warps, stages, heads), for every BLOCK_T. 64 heads: run AC's Nsight Compute
# found the 128-head mix pass at 255 registers a thread, one program an SM.
MIX = [(256, 8, 3, 128), (256, 8, 2, 128), (128, 4, 3, 128), (64, 4, 4, 128)]
# The flat mix loop (LaunchConfig.mix_flat: no spills at 256/8/3, 5 barriers a tile for 15).
MIX_FLAT = [(256, 8, 3, 128), (128, 4, 3, 128)]
MIX_64 = [(256, 8, 3, 64), (128, 4, 3, 64), (128, 4, 2, 64), (64, 4, 4, 64)]
FUSED = [
    ("fused bn64 st2", None, dict(block_n=64, num_stages=2)),
    ("fused split2 bn32 st3", 2, dict(block_n=32, num_stages=3)),
]


def chunks(bs: int, bt: int, heads: int) -> list[int]:
    """Chunk lengths worth timing: grids of about half a wave to eight waves of 132 SMs."""
    waves = [(c, -(-K // c) * bs * (H // heads) / 132) for c in CHUNKS if c >= bt]
    return (
        [c for c, w in waves if 0.5 <= w <= 8] or [waves[0][0]] if CUDA else [w[0] for w in waves]
    )


def inputs(bs: int, fmt: str):
    g = torch.Generator(device=DEV).manual_seed(bs)
    rows = torch.randn((bs * B, 576), device=DEV, dtype=torch.bfloat16, generator=g)
    kv, row_format = rows, ROW_FORMATS[fmt]
    if row_format.quantize is not None:
        kv = torch.empty((bs * B, row_format.row_bytes), device=DEV, dtype=torch.uint8)
        kv_quantize(rows, kv, row_format=row_format)
    q = torch.randn((bs, H, 512), device=DEV, dtype=torch.bfloat16, generator=g)
    qp = torch.randn((bs, H, 64), device=DEV, dtype=torch.bfloat16, generator=g)
    base = torch.arange(bs, device=DEV, dtype=torch.int64) * B
    slots = torch.argsort(torch.rand(bs, B, device=DEV, generator=g), 1)[:, :K].to(torch.int32)
    slots[:, -5:] = -1  # a few padding slots, as the engine's lists have
    return q, qp, kv, base, slots


def time_us(fn, reps: int) -> float:
    try:
        if not CUDA:
            t0 = time.perf_counter()
            fn()
            return 1e6 * (time.perf_counter() - t0)
        return graph_time_us(fn, reps, inner=5)
    except Exception as exc:  # a config over the shared-memory limit: recorded, not fatal
        print(f"    ERROR {repr(exc)[:100]}", flush=True)
        return float("nan")


def _timed(results: list, fn, reps: int, **row) -> None:
    results.append({**row, "us": time_us(fn, reps)})


def _best(rows: list[dict], **match) -> dict | None:
    ok = [r for r in rows if all(r[k] == v for k, v in match.items()) and r["us"] == r["us"]]
    return min(ok, key=lambda r: r["us"], default=None)


def sweep_format(fmt: str, bs: int, reps: int, ceil: dict, heads: tuple[int, ...] = (128,)) -> dict:
    q, qp, kv, base, slots = inputs(bs, fmt)
    row_format = ROW_FORMATS[fmt]
    out = torch.empty((bs, H, 512), device=DEV, dtype=torch.bfloat16)
    lse = torch.empty((bs, H), device=DEV, dtype=torch.float32)
    res: dict = {"fmt": fmt, "bs": bs, "score": [], "mix": [], "fused": [], "best": {}}

    def attend(ws, **kw):
        return lambda: sparse_mla_decode(
            q, qp, kv, base, slots, SCALE, out, lse, row_format=row_format, workspace=ws, **kw
        )

    for label, splits, kw in FUSED:
        ws = AttnWorkspace.allocate(bs, H, splits, device=DEV) if splits else None
        _timed(res["fused"], attend(ws, **kw), reps, label=label)
    args = (q, qp, kv, base, slots, row_format)
    for bt in sorted({v[0] for v in SCORE[fmt]}):
        ws = TileWorkspace.allocate(bs, H, K, row_format=row_format, block_t=bt, device=DEV)
        _time_passes(res, fmt, bs, bt, ws, args, (out, lse), reps, heads)
        best = _best_pair(res, bt, attend, ws, args, (out, lse), reps)
        if best is not None:
            res["best"][bt] = best
    for r in res["score"] + res["mix"]:
        r["cfg"] = r["cfg"].__dict__
    res["hbm_floor_us"] = K * kv.shape[1] * kv.element_size() / (ceil["d2d_gbs"] * 1e3)
    res["mm_floor_us"] = FLOP / (ceil["mm_tflops"] * 1e6)
    return res


def _time_passes(
    res: dict, fmt: str, bs: int, bt: int, ws, args: tuple, outs: tuple, reps: int, heads: tuple
) -> None:
    """Each score-pass and mix-pass configuration of tile `bt`, timed alone; the score pass at
    each count of `heads` per program (fewer than 128: on 4 and 8 warps)."""
    q, qp, kv, base, slots, row_format = args
    out, lse = outs
    qk_scale = SCALE * 1.4426950408889634
    for _, stages in [v for v in SCORE[fmt] if v[0] == bt]:
        for h in heads:
            for warps, pf in [(8, False), (8, True)] if h == H else [(4, False), (8, False)]:
                for chunk in chunks(bs, bt, h):
                    cfg = LaunchConfig(
                        score_heads=h,
                        chunk=chunk,
                        score_warps=warps,
                        score_stages=stages,
                        score_prefetch=pf,
                    )
                    fn = lambda cfg=cfg: score_pass(  # noqa: E731
                        q, qp, kv, base, slots, qk_scale, ws, cfg, row_format
                    )
                    _timed(res["score"], fn, reps, bt=bt, cfg=cfg)
    variants = [(v, False) for v in MIX + (MIX_64 if min(heads) < H else [])]
    for (cols, warps, stages, mh), flat in variants + [(v, True) for v in MIX_FLAT]:
        cfg = LaunchConfig(
            mix_cols=cols, mix_warps=warps, mix_stages=stages, mix_heads=mh, mix_flat=flat
        )
        fn = lambda cfg=cfg: mix_pass(kv, base, slots, out, lse, ws, cfg, row_format)  # noqa: E731
        _timed(res["mix"], fn, reps, bt=bt, cfg=cfg)


def _best_pair(res: dict, bt: int, attend, ws, args: tuple, outs: tuple, reps: int) -> dict | None:
    """The fastest score and mix passes of tile `bt` launched together, timed and checked."""
    sb, mb = _best(res["score"], bt=bt), _best(res["mix"], bt=bt)
    if sb is None or mb is None:
        return None
    cfg = _merge(sb["cfg"], mb["cfg"])
    others = [
        _merge(s["cfg"], m["cfg"])
        for s, m in zip(
            [r for r in res["score"] if r["bt"] == bt and r["us"] == r["us"]][::-1],
            [r for r in res["mix"] if r["bt"] == bt and r["us"] == r["us"]][::-1],
        )
    ][:2]
    return {
        "cfg": cfg.__dict__,
        "us": time_us(attend(ws, launch=cfg), reps),
        "score_us": sb["us"],
        "mix_us": mb["us"],
        **check(attend, ws, cfg, others, args, *outs),
    }


def _merge(s: LaunchConfig, m: LaunchConfig) -> LaunchConfig:
    return LaunchConfig(
        score_heads=s.score_heads,
        chunk=s.chunk,
        score_warps=s.score_warps,
        score_stages=s.score_stages,
        score_prefetch=s.score_prefetch,
        mix_cols=m.mix_cols,
        mix_heads=m.mix_heads,
        mix_flat=m.mix_flat,
        mix_warps=m.mix_warps,
        mix_stages=m.mix_stages,
    )


def check(attend, ws, cfg, others, args, out, lse) -> dict:
    """Bits of the chosen launch against other (timed) launches of the same tiles; the fp64
    reference on the first 4 rows."""
    attend(ws, launch=cfg)()
    o1, l1 = out.clone(), lse.clone()
    same = True
    for other in others:
        attend(ws, launch=other)()
        same &= bool(torch.equal(out, o1) and torch.equal(lse, l1))
    q, qp, kv, base, slots, row_format = args
    n = min(4, q.shape[0])
    ro = torch.empty((n, H, 512), dtype=torch.float64, device=DEV)
    rl = torch.empty((n, H), dtype=torch.float64, device=DEV)
    ref_sparse_mla_decode(
        q[:n], qp[:n], kv, base[:n], slots[:n], SCALE, ro, rl, row_format=row_format
    )
    rel = ((o1[:n].double() - ro).norm(dim=-1) / ro.norm(dim=-1)).max().item()
    return {
        "bits_equal_across_launches": same,
        "launches_compared": len(others) + 1,
        "rel_err": rel,
        "lse_err": (l1[:n].double() - rl).abs().max().item(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batches", default="8,64,128" if CUDA else "2")
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--heads",
        default=str(H),
        help="heads per score program, comma-separated (a K tile then gathered H / heads times)",
    )
    ap.add_argument("--out", default="bench/results/attention_sweep.json")
    args = ap.parse_args()
    ceil = measure_ceilings() if CUDA else {"d2d_gbs": 1.0, "mm_tflops": 1.0, "h2d_gbs": 1.0}
    print(f"ceilings {ceil}", flush=True)
    results = []
    for fmt in args.formats.split(","):
        for bs in map(int, args.batches.split(",")):
            t0 = time.time()
            heads = tuple(map(int, args.heads.split(",")))
            results.append(sweep_format(fmt, bs, 5 if args.quick else 15, ceil, heads))
            print(f"  {fmt} bs{bs} done in {time.time() - t0:.0f}s", flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(
                json.dumps(
                    {"ceilings": ceil, "runs": results, "device": DEV}, indent=1, default=str
                )
            )
    print_summary(results)
    return 0


def print_summary(results: list[dict]) -> None:
    print(
        f"\n{'fmt':<5}{'bs':>5} {'fused':>9} {'split2':>9} {'BT':>3} {'2-pass':>9} {'us/rl':>6} "
        f"{'TFLOPS':>7} {'xHBM':>5} bits rel_err  cfg"
    )
    for r in results:
        fz = [f["us"] for f in r["fused"]]
        for bt, v in r["best"].items():
            rl = v["us"] / r["bs"]
            print(
                f"{r['fmt']:<5}{r['bs']:>5} {fz[0]:>9.1f} {fz[1]:>9.1f} {bt:>3} {v['us']:>9.1f} "
                f"{rl:>6.2f} {FLOP / (rl * 1e6):>7.0f} {rl / r['hbm_floor_us']:>5.1f} "
                f"{'ok' if v['bits_equal_across_launches'] else 'DIFF'} {v['rel_err']:.1e}  "
                f"{v['cfg']}"
            )


if __name__ == "__main__":
    raise SystemExit(main())

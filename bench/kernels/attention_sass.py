"""The two-pass attention's kernels compiled for sm_90 on this machine (no GPU needed): registers,
spill stack (STL/LDL), shared memory and tensor-core instructions per launch variant, through
bench/kernels/sm90_report.py. Run AC's Nsight Compute found both passes at one program an SM;
this says which variants would fit more before a device call times them. `score_report` and
`mix_report` are also what bench/kernels/coresidency.py compiles the table's launches with.

    python -m bench.kernels.attention_sass [--row-format fp8] [--mix 128:256:8:3,64:128:4:2]
        [--score 128:64:8:1,64:32:4:1]

--mix: HEADS:COLUMNS:WARPS:STAGES per variant (64-row tiles); --score: HEADS:TILE_ROWS:WARPS:STAGES
(slot lists staged 256 at a time: the table's fp8 chunk at 97-128 requests). The numbers follow
the local Triton (the device runs 3.6; install that version to match).
"""

from __future__ import annotations

import argparse

from bench.kernels.sm90_report import compile_report

# k 2048 slots, as V3.2 decodes.
TOPK = 2048


def _common(fp8: bool, rows: int) -> tuple[dict, dict]:
    """Both passes' pointer types and compile-time values. No host tier: host_off None and
    HOST_ROWS off, as sparse_mla_decode launches them without."""
    ptrs = {"row_base_ptr": "*i64", "slots_ptr": "*i32", "kv_ptr": "*u8" if fp8 else "*bf16"}
    ptrs |= {"p_ptr": "*bf16", "pm_ptr": "*fp32", "pl_ptr": "*i64"}
    consts = {"BLOCK_T": rows, "UPCAST": False, "ROW_FP8": fp8, "HOST_ROWS": False}
    return ptrs, consts | {"host_off": None}


def score_report(fp8: bool, heads: int, rows: int, warps: int, stages: int, stage: int) -> dict:
    """The score pass at `heads` a program, `rows`-row tiles, slot lists staged `stage` at a
    time (sparse.py: max(rows, min(512, chunk)))."""
    from kernels.attention import two_pass
    from kernels.formats import LATENT_DIM, ROPE_DIM

    ptrs, consts = _common(fp8, rows)
    types = ptrs | {"q_nope_ptr": "*bf16", "q_pe_ptr": "*bf16", "qk_scale": "fp32"}
    consts |= {"BLOCK_H": heads, "D_V": LATENT_DIM, "D_PE": ROPE_DIM, "STAGE": stage}
    return compile_report(two_pass._score_kernel, types, consts, **_opts(warps, stages))


def mix_report(fp8: bool, heads: int, rows: int, cols: int, warps: int, stages: int) -> dict:
    """The mix pass at `heads` a program and `cols` output columns, over k = TOPK slots."""
    from kernels.attention import two_pass

    ptrs, consts = _common(fp8, rows)
    types = ptrs | {"out_ptr": "*bf16", "lse_ptr": "*fp32"}
    consts |= {"BLOCK_H": heads, "BLOCK_D": cols, "NT_POW2": TOPK // rows, "STAGE": 512}
    return compile_report(two_pass._mix_kernel, types, consts, **_opts(warps, stages))


def _opts(warps: int, stages: int) -> dict[str, int]:
    return {"num_warps": warps, "num_stages": stages}


def _variants(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in spec.split(":")) for spec in text.split(",") if spec]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row-format", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--mix", default="128:256:8:3,128:128:4:3,64:256:8:3,64:128:4:2,64:64:4:4")
    ap.add_argument("--score", default="128:64:8:1,64:32:4:1")
    args = ap.parse_args(argv)
    fp8 = args.row_format == "fp8"
    for heads, rows, warps, stages in _variants(args.score):
        score_report(fp8, heads, rows, warps, stages, max(rows, 256))
    for heads, cols, warps, stages in _variants(args.mix):
        mix_report(fp8, heads, 64, cols, warps, stages)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

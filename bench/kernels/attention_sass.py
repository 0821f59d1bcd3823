"""The two-pass attention's kernels compiled for sm_90 on this machine (no GPU needed): registers,
spill stack (STL/LDL), shared memory and tensor-core instructions per launch variant, through
bench/kernels/sm90_report.py. Run AC's Nsight Compute found both passes at one program an SM;
this says which variants would fit more before a device call times them.

    python -m bench.kernels.attention_sass [--row-format fp8] [--mix 128:256:8:3,64:128:4:2]
        [--score 128:64:8:1,64:32:4:1]

--mix: HEADS:COLUMNS:WARPS:STAGES per variant (64-row tiles); --score: HEADS:TILE_ROWS:WARPS:STAGES
(slot lists staged 256 at a time: the table's fp8 chunk at 97-128 requests). The numbers follow
the local Triton (the device runs 3.6; install that version to match).
"""

from __future__ import annotations

import argparse

from bench.kernels.sm90_report import compile_report

_PTRS = {"row_base_ptr": "*i64", "slots_ptr": "*i32", "p_ptr": "*bf16", "pm_ptr": "*fp32"}
_PTRS |= {"pl_ptr": "*i64"}


def _variants(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in spec.split(":")) for spec in text.split(",") if spec]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row-format", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--mix", default="128:256:8:3,128:128:4:3,64:256:8:3,64:128:4:2,64:64:4:4")
    ap.add_argument("--score", default="128:64:8:1,64:32:4:1")
    args = ap.parse_args(argv)
    from kernels.attention import two_pass
    from kernels.formats import LATENT_DIM, ROPE_DIM

    fp8 = args.row_format == "fp8"
    ptrs = _PTRS | {"kv_ptr": "*u8" if fp8 else "*bf16"}
    common = {"UPCAST": False, "ROW_FP8": fp8, "HOST_ROWS": False, "host_off": None}
    for heads, rows, warps, stages in _variants(args.score):
        consts = {"BLOCK_H": heads, "BLOCK_T": rows, "D_V": LATENT_DIM, "D_PE": ROPE_DIM}
        types = ptrs | {"q_nope_ptr": "*bf16", "q_pe_ptr": "*bf16", "qk_scale": "fp32"}
        compile_report(
            two_pass._score_kernel, types, common | consts | {"STAGE": 256}, **_opts(warps, stages)
        )
    for heads, cols, warps, stages in _variants(args.mix):
        consts = {"BLOCK_H": heads, "BLOCK_T": 64, "BLOCK_D": cols, "NT_POW2": 32, "STAGE": 512}
        types = ptrs | {"out_ptr": "*bf16", "lse_ptr": "*fp32"}
        compile_report(two_pass._mix_kernel, types, common | consts, **_opts(warps, stages))
    return 0


def _opts(warps: int, stages: int) -> dict[str, int]:
    return {"num_warps": warps, "num_stages": stages}


if __name__ == "__main__":
    raise SystemExit(main())

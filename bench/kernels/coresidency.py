"""Which of the decode step's kernels leave room on an SM for the side stream's miss copy
(issue 38 item 2, scheduling): a copy CTA runs beside a compute kernel only where that kernel's
resident CTAs leave registers, shared memory and warp slots free; elsewhere it waits until an SM
drains. Compiles each kernel for sm_90 on this machine (bench/kernels/sm90_report.py: registers
and shared memory as the local Triton builds them; the device's Triton, 3.6, may differ).

    python -m bench.kernels.coresidency [--part-batch 111] [--row-format fp8]

Prints per kernel: registers a thread, shared memory a CTA, warps, its CTAs per SM, and how many
CTAs of each copy variant fit beside them on one SM. Measured nothing on a GPU: which resources
really bound the copy in situ is for ncu and bench/profile/copy_sweep.py to say.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# sm_90, per SM: registers (allocated per warp in units of 256), shared memory (227 KB at most a
# CTA, 1 KB reserved by the driver per CTA), warp slots, CTA slots.
REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED_PER_CTA = 65536, 233472, 1024
WARPS_PER_SM, CTAS_PER_SM = 64, 32
# Copy variants: (chunk bytes, warps); the default is CopyGrid's, 8 KiB and 4 warps.
COPY_VARIANTS = ((8192, 4), (4096, 2), (16384, 8))


@dataclass(frozen=True)
class Footprint:
    """What one CTA of a kernel holds on an SM."""

    name: str
    regs: int  # per thread
    smem: int  # bytes per CTA
    warps: int

    def reg_words(self) -> int:
        return -(-self.regs * 32 // 256) * 256 * self.warps

    def smem_bytes(self) -> int:
        return self.smem + SMEM_RESERVED_PER_CTA


def ctas_per_sm(
    k: Footprint,
    regs: int = REGS_PER_SM,
    smem: int = SMEM_PER_SM,
    warps: int = WARPS_PER_SM,
    ctas: int = CTAS_PER_SM,
) -> int:
    """CTAs of k that fit in the given free resources of one SM."""
    return max(0, min(regs // k.reg_words(), smem // k.smem_bytes(), warps // k.warps, ctas))


def beside(compute: Footprint, copy: Footprint) -> int:
    """Copy CTAs that fit on an SM holding as many CTAs of `compute` as it can."""
    n = ctas_per_sm(compute)
    return ctas_per_sm(
        copy,
        REGS_PER_SM - n * compute.reg_words(),
        SMEM_PER_SM - n * compute.smem_bytes(),
        WARPS_PER_SM - n * compute.warps,
        CTAS_PER_SM - n,
    )


def _compiled(fn, types: dict, consts: dict, name: str, warps: int, stages: int) -> Footprint:
    from bench.kernels.sm90_report import compile_report

    r = compile_report(fn, types, consts, num_warps=warps, num_stages=stages)
    return Footprint(name, r["regs"], r["smem"], warps)


def attention(part_batch: int, fp8: bool) -> list[Footprint]:
    """The two-pass decode's kernels at the launch configuration the table picks for the batch,
    as kernels/attention/sparse.py launches them for 128 heads."""
    from bench.kernels.attention_sass import mix_report, score_report
    from kernels.attention.configs import TILE_ROWS, launch_config
    from kernels.formats import ROW_FORMATS

    fmt = ROW_FORMATS["fp8" if fp8 else "bf16"]
    cfg, bt = launch_config(fmt, part_batch), TILE_ROWS[fmt.kernel]
    stage = max(bt, min(512, cfg.chunk))
    score = score_report(fp8, cfg.score_heads, bt, cfg.score_warps, cfg.score_stages, stage)
    mix = mix_report(fp8, cfg.mix_heads, bt, cfg.mix_cols, cfg.mix_warps, cfg.mix_stages)
    return [
        Footprint(
            f"attention score ({cfg.score_warps} warps, {cfg.score_stages} stages)",
            score["regs"],
            score["smem"],
            cfg.score_warps,
        ),
        Footprint(
            f"attention mix ({cfg.mix_cols} columns, {cfg.mix_warps} warps, "
            f"{cfg.mix_stages} stages)",
            mix["regs"],
            mix["smem"],
            cfg.mix_warps,
        ),
    ]


def indexer() -> Footprint:
    """The lightning indexer over fp8 keys at its wrapper's defaults (kernels/select/indexer.py)."""
    from kernels.select.indexer import _indexer_kernel

    types = {"q_ptr": "*bf16", "w_ptr": "*fp32", "pool_ptr": "*u8", "scale_ptr": "*fp32"}
    types |= {"page_table_ptr": "*i32", "req_slots_ptr": "*i32", "seq_lens_ptr": "*i32"}
    consts = {"N_HEADS": 64, "D": 128, "PAGE": 64, "FP8": True, "ALIGN": 128, "BLOCK_T": 128}
    consts |= {"TILES": 4, "REG_PREFETCH": True, "ROWS_FIRST": False, "UPCAST": False}
    return _compiled(
        _indexer_kernel, types | {"out_ptr": "*fp32"}, consts, "indexer (fp8 keys)", 4, 1
    )


def copies(row_bytes: int) -> list[Footprint]:
    from kernels.swap.miss_copy import _miss_copy_kernel

    types = {"host_ptr": "*u8", "hot_ptr": "*u8", "src_ptr": "*i64", "dst_ptr": "*i64"}
    out = []
    for chunk, warps in COPY_VARIANTS:
        consts = {"VW": 4, "VPR": row_bytes // 16, "VECTORS": chunk // 16, "BS_BLOCK": 256}
        consts |= {"PREFETCH": False, "STAGES": 1}
        name = f"copy {chunk // 1024}K x{warps}"
        out.append(
            _compiled(_miss_copy_kernel, types | {"count_ptr": "*i32"}, consts, name, warps, 3)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--part-batch", type=int, default=111, help="rows of one micro-batch part [111]"
    )
    ap.add_argument("--row-format", choices=("fp8", "bf16"), default="fp8")
    args = ap.parse_args(argv)
    # First: it turns Triton's interpreter off before kernels/ define their kernels.
    import bench.kernels.sm90_report  # noqa: F401

    fp8 = args.row_format == "fp8"
    kernels = attention(args.part_batch, fp8) + [indexer()]
    from kernels.formats import ROW_FORMATS

    cps = copies(ROW_FORMATS[args.row_format].row_bytes)
    head = f"{'kernel':<52} {'regs':>4} {'smem KB':>7} {'warps':>5} {'CTAs/SM':>7}"
    print("\n" + head + "".join(f" {c.name:>12}" for c in cps))
    for k in kernels:
        row = f"{k.name:<52} {k.regs:>4} {k.smem / 1024:>7.1f} {k.warps:>5} {ctas_per_sm(k):>7}"
        print(row + "".join(f" {beside(k, c):>12}" for c in cps))
    print("(the last columns: copy CTAs that fit beside a full SM of the kernel)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Registers and spills of the miss copy as the device compiled it, and the occupancy they allow
(issue 38 item 2: ncu found the copy's theoretical occupancy 56%, limited by registers).

    python -m bench.kernels.copy_regs            # GPU: launches each variant once on tiny lists
    python -m bench.kernels.copy_regs --sm90     # no GPU: compiles for sm_90 (sm90_report)

Variants: both row formats (656 and 1152 bytes) at chunks of 4, 8 (the default) and 16 KiB of 4
warps, 16 KiB of 8 warps, and 4 and 8 KiB with the row-number prefetch.
"""

from __future__ import annotations

import argparse

ROW_BYTES = (656, 1152)
# (chunk bytes, warps, row-number prefetch)
VARIANTS = ((4096, 4, False), (8192, 4, False), (16384, 4, False), (16384, 8, False))
VARIANTS += ((4096, 4, True), (8192, 4, True))
# sm_90 per SM: 65,536 registers allocated per warp in units of 256, 64 warps, 32 CTAs.
REGS_PER_SM, WARPS_PER_SM, CTAS_PER_SM = 65536, 64, 32


def occupancy(regs: int, warps: int) -> float:
    """Theoretical occupancy when registers are the limit (shared memory is not: 16 B)."""
    per_warp = -(-regs * 32 // 256) * 256
    ctas = min(REGS_PER_SM // (per_warp * warps), CTAS_PER_SM, WARPS_PER_SM // warps)
    return ctas * warps / WARPS_PER_SM


def on_device() -> list[dict]:
    """Launch every variant, then read registers and spills off Triton's compiled kernels."""
    import torch

    from kernels.swap.miss_copy import _miss_copy_kernel, miss_copy
    from kernels.uva import UVATensor

    for d in ROW_BYTES:
        host = torch.zeros((64, d), dtype=torch.uint8).pin_memory()
        hot = torch.zeros((64, d), dtype=torch.uint8, device="cuda")
        rows = torch.arange(8, device="cuda").view(2, 4)
        count = torch.full((2,), 4, dtype=torch.int32, device="cuda")
        for chunk, warps, prefetch in VARIANTS:
            kw = dict(chunk_bytes=chunk, num_warps=warps, prefetch=prefetch)
            miss_copy(UVATensor(host), hot, rows, rows, count, **kw)
    torch.cuda.synchronize()
    out = []
    for cache in _miss_copy_kernel.device_caches.values():
        for kernel in cache[0].values():
            if getattr(kernel, "n_regs", None) is None:
                kernel._init_handles()
            consts = getattr(kernel.src, "constants", {})
            names = _miss_copy_kernel.arg_names
            named = {names[k[0]] if isinstance(k, tuple) else k: v for k, v in consts.items()}
            out.append(
                {
                    "row_bytes": 4 * named.get("VW", 0) * named.get("VPR", 0),
                    "chunk": 16 * named.get("VECTORS", 0),
                    "warps": kernel.metadata.num_warps,
                    "prefetch": bool(named.get("PREFETCH", False)),
                    "regs": kernel.n_regs,
                    "spills": kernel.n_spills,
                }
            )
    return out


def offline() -> list[dict]:
    """Compile for sm_90 on this machine (its Triton may differ from the device's)."""
    from bench.kernels.sm90_report import compile_report
    from kernels.swap.miss_copy import _miss_copy_kernel

    types = {"host_ptr": "*u8", "hot_ptr": "*u8", "src_ptr": "*i64", "dst_ptr": "*i64"}
    types["count_ptr"] = "*i32"
    out = []
    for d in ROW_BYTES:
        for chunk, warps, prefetch in VARIANTS:
            consts = {"VW": 4, "VPR": d // 16, "VECTORS": chunk // 16, "BS_BLOCK": 256}
            consts |= {"PREFETCH": prefetch, "STAGES": 1}
            r = compile_report(_miss_copy_kernel, types, consts, num_warps=warps)
            out.append(
                {"row_bytes": d, "chunk": chunk, "warps": warps, "prefetch": prefetch}
                | {"regs": r["regs"], "spills": r["stack"]}
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sm90", action="store_true", help="compile offline for sm_90 instead")
    args = ap.parse_args(argv)
    rows = offline() if args.sm90 else on_device()
    head = f"{'row B':>6} {'chunk':>6} {'warps':>5} {'prefetch':>8} {'regs':>5} {'spills':>6}"
    print(f"\n{head} {'occupancy':>9}")
    for r in sorted(rows, key=lambda r: (r["row_bytes"], r["chunk"], r["warps"], r["prefetch"])):
        print(
            f"{r['row_bytes']:>6} {r['chunk']:>6} {r['warps']:>5} {str(r['prefetch']):>8} "
            f"{r['regs']:>5} {r['spills']:>6} {occupancy(r['regs'], r['warps']):>9.0%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Kernel benchmark: every kernel against its comparison, measured in one run.

    python -m bench.kernels [--out bench/results/kernels.json] [--quick] [--cases miss_copy]
    python -m bench.kernels --cases sglang_swap  (against SGLang's swap-in: sglang_anchor.py)
    python -m bench.kernels --cases host_read    (attention reading misses in place vs copying)

Needs CUDA. Prints a table last and writes JSON. GPU times come from CUDA graphs replayed
between events, so Python launch cost is excluded; the CPU cost of one wrapper call is
measured separately (the wrappers' own overhead, which a captured graph avoids).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.kernels import (
    attention_cases,
    beside_cases,
    copy_layout_cases,
    host_read_cases,
    kernel_cases,
    miss_copy_cases,
    overlap_cases,
    select_cases,
    sglang_swap_cases,
    swap_cases,
)
from bench.shared.timing import Row, measure_ceilings, print_table


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="bench/results/kernels.json", help="JSON results path")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument(
        "--cases", default="", help="comma-separated substrings of case names to run (default: all)"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels/cli.py needs CUDA", file=sys.stderr)
        return 2
    reps = 5 if args.quick else 20
    ceil = measure_ceilings()
    print(
        f"ceilings: pinned H2D {ceil['h2d_gbs']:.1f} GB/s, D2D {ceil['d2d_gbs']:.0f} GB/s "
        f"(read+write), bf16 matmul {ceil['mm_tflops']:.0f} TFLOP/s",
        flush=True,
    )
    rows = run_cases(ceil, reps, [w for w in args.cases.split(",") if w])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "ceilings": ceil,
        "rows": [r.__dict__ for r in rows],
    }
    out.write_text(json.dumps(payload, indent=2))
    print_table(rows)
    return 0


def run_cases(ceil: dict, reps: int, wanted: list[str]) -> list[Row]:
    """Every case whose name contains one of `wanted` (all without), in module order; a case
    that raises gives an ERROR row."""
    rows: list[Row] = []
    modules = (
        kernel_cases,
        swap_cases,
        attention_cases,
        host_read_cases,
        select_cases,
        miss_copy_cases,
        copy_layout_cases,
        overlap_cases,
        beside_cases,
        sglang_swap_cases,
    )
    for case in [c for m in modules for c in m.ALL]:
        if wanted and not any(w in case.__name__ for w in wanted):
            continue
        t0 = time.time()
        try:
            rows.extend(case(ceil, reps))
        except Exception as exc:  # a broken case must not hide the others' numbers
            rows.append(Row(case.__name__, "ERROR", float("nan"), float("nan"), repr(exc)[:120]))
        print(f"  {case.__name__} done in {time.time() - t0:.1f}s", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

"""The miss copy alone, for Nsight Compute (issue 30): one launch per row format on the same
step-shaped miss lists (bs 111 = one micro-batch of N 222, 13% of k, 1 GiB pinned host tier),
on the side stream's grid (OVERLAP_COPY_GRID: its rule picks the working CTAs), 64 CTAs all
working, and the default grid.

    ncu --clock-control none -k regex:miss_copy --launch-skip 6 \\
        --section SpeedOfLight ... python3 bench/ncu_copy.py

(bench/gpu_session.sh's ncu stage.) The profile.py step under ncu ran past 75 s in run I (every
launch of the model's build intercepted); this script launches little besides the copies. The
first round of launches (6) compiles and warms up; the second is the one to profile.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.miss_copy_cases import B, miss_lists  # noqa: E402
from engine_client.kv.hisparse import OVERLAP_COPY_GRID  # noqa: E402
from kernels.swap.copy_grid import CopyGrid  # noqa: E402
from kernels.swap.miss_copy import miss_copy  # noqa: E402
from kernels.uva import UVATensor  # noqa: E402

BS, RATE, TIER = 111, 0.13, 1 << 30


def main() -> int:
    flat = torch.empty(TIER, dtype=torch.uint8, pin_memory=True)
    cases = []
    for d in (656, 1152):
        g = torch.Generator().manual_seed(d)
        host = flat[: TIER // d * d].view(-1, d)
        lists = miss_lists(BS, RATE, host.shape[0], g)
        hot = torch.empty((BS * B, d), dtype=torch.uint8, device="cuda")
        for grid in (OVERLAP_COPY_GRID, CopyGrid(programs=64), CopyGrid()):
            cases.append((UVATensor(host), hot, lists, grid))
    for _ in range(2):  # warm-up round, then the profiled round
        for uva, hot, lists, grid in cases:
            miss_copy(uva, hot, *lists, grid=grid)
        torch.cuda.synchronize()
    for uva, hot, lists, grid in cases:
        rows = int(lists[2].sum())
        print(f"{hot.shape[1]} B rows, {rows} rows, grid {grid.label()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

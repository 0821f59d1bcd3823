"""The engine's staged miss copy in a CUDA graph against its SM copy (issue 38 item 2; bench/
NOTES-datapath.md "A copy without SM loads").

A step's part as the engine holds it: fp8 rows, bs 111, 13% misses (bench/kernels/
beside_cases.py), the plan's [bs, k] miss lists on the device. Two graphs on a side stream:
- `sm`: miss_copy on the engine's overlap grid (engine_client/kv/hisparse.py);
- `staged B cC tT`: kernels/swap/staged_copy.py's StagedCopy with a budget of B bytes, C
  slices, T host threads: the lists come down, host nodes gather (host_gather.c), the copy
  engine uploads, miss_copy scatters from the landing and reads the rows past the budget.
Each replays with fresh lists behind it, its rows checked; then timed alone and beside a GEMM
and the mix pass on the main stream (each neighbour's time a launch against alone).

    python -m bench.kernels.host_node [--staged 20M:4:16,20M:8:16,12M:2:8] [--out PATH]

GPU only; needs a C compiler for host_gather.c. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from bench.kernels.beside_cases import BS, RATE, _alone_ms, _neighbours
from bench.kernels.host_gather import beside_rows
from bench.kernels.miss_copy_cases import B, K, _Tier, miss_lists
from bench.shared.timing import Row, measure_ceilings, print_table
from kernels.swap.copy_grid import CopyGrid
from kernels.uva import UVATensor

D = 656  # V3.2's fp8 rows


def _graph(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile, build and allocate outside the graph
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _checked(graph, host_rows, hot, lists, g) -> bool:
    """Fresh sources behind the same lists' buffers (anywhere in the tier, as the engine's),
    random bytes in the 64 rows checked, one replay, those rows compared."""
    src, dst, count = lists
    src.copy_(miss_lists(BS, RATE, host_rows.shape[0], g)[0])
    live = torch.arange(K, device="cuda")[None, :] < count[:, None].long()
    s, d = src[live][:64].cpu(), dst[live][:64]
    host_rows[s] = torch.randint(0, 256, (s.numel(), D), dtype=torch.uint8, generator=g)
    hot.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(hot[d].cpu(), host_rows[s]))


def run(args) -> tuple[list[Row], dict]:
    from engine_client.kv.hisparse import OVERLAP_COPY_GRID
    from kernels.swap.miss_copy import miss_copy
    from kernels.swap.staged_copy import StagedCopy

    pinned = measure_ceilings()["h2d_gbs"]
    tier = _Tier(args.tier_gib << 30)
    host_rows = tier.rows(D)
    g = torch.Generator().manual_seed(38)
    # Sources over the whole tier, as the engine's (run AF's lay in 43 MB, where the SM copy
    # read at 0.84 of pinned against 0.48 over 4 GiB).
    lists = miss_lists(BS, RATE, host_rows.shape[0], g)
    hot = torch.zeros((BS * B, D), dtype=torch.uint8, device="cuda")
    uva = UVATensor(host_rows)
    nbytes = int(lists[2].clamp(0, K).sum()) * D
    neighbours = {k: v for k, v in _neighbours().items() if k in ("gemm", "mix pass")}
    one = {k: _alone_ms(v, args.reps) for k, v in neighbours.items()}
    graphs = {"sm": _graph(lambda: miss_copy(uva, hot, *lists, grid=OVERLAP_COPY_GRID))}
    keep = []  # a graph holds the staged copy's buffers and jobs by address: keep them alive
    for spec in args.staged.split(","):
        budget, chunks, threads = spec.split(":")
        grid = CopyGrid.parse(f"default+h{budget}c{chunks}t{threads}", default=OVERLAP_COPY_GRID)
        staged = StagedCopy(D, BS, K, grid.staged_bytes // D, torch.device("cuda"),
                            chunks=grid.staged_chunks, threads=grid.staged_threads)  # fmt: skip
        copy = dataclasses.replace(grid, staged_bytes=0)
        keep.append(staged)
        graphs[f"staged {grid.label()}"] = _graph(
            lambda s=staged, c=copy: s.copy(uva, hot, *lists, grid=c)
        )
    table, report = [], {"pinned_gb_per_s": pinned, "bytes": nbytes, "cases": {}}
    for name, graph in graphs.items():
        ok = all(_checked(graph, host_rows, hot, lists, g) for _ in range(2))
        rows, entry = beside_rows(name, graph.replay, nbytes, pinned, neighbours, one, args.reps)
        rows[0].note += "" if ok else "  ROWS WRONG"
        table += rows
        report["cases"][name] = {"rows_ok": ok, **entry}
    return table, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--staged", default="20M:4:16,20M:8:16,12M:2:8",
                    help="budget:chunks:threads of each staged case")  # fmt: skip
    ap.add_argument("--tier-gib", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_node needs a GPU")
    table, report = run(args)
    print(f"pinned copy {report['pinned_gb_per_s']:.1f} GB/s; {report['bytes'] >> 20} MiB a part")
    print_table(table)
    report["device"] = torch.cuda.get_device_name()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

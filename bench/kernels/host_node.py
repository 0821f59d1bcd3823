"""The host gather inside a CUDA graph (bench/NOTES-datapath.md "A copy without SM loads"): can
the captured decode step carry a copy that no SM loads?

One graph on a side stream, as the engine's step would hold it per part: the miss list and its
row count come down (memcpy nodes into pinned memory), a host node runs host_gather.c's
`gather_job_run` (cuLaunchHostFunc, captured; the count is read when it runs), the staging goes
up in one copy-engine memcpy, and index_copy_ scatters the rows into their hot slots. Each
replay gets fresh host rows behind the same count; the rows are checked after every replay.

    python -m bench.kernels.host_node [--threads 8] [--reps 20] [--out PATH]

Prints the replay's time and rate against the pinned copy, alone and beside a GEMM on the main
stream (its time a launch against alone). GPU only; needs gcc for host_gather.c.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import torch

from bench.kernels.beside_cases import BS, RATE, _alone_ms, _together_ms
from bench.kernels.host_gather import D, _compact, native_library
from bench.kernels.miss_copy_cases import B, _Tier, miss_lists
from bench.shared.timing import events_ms, measure_ceilings


class _Job(ctypes.Structure):  # host_gather.c's gather_job
    _fields_ = [
        ("host", ctypes.c_void_p),
        ("idx", ctypes.c_void_p),
        ("count", ctypes.c_void_p),
        ("d", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("threads", ctypes.c_int),
    ]


class GraphGather:
    """The captured path for n rows; `src` and `dst` (device, int64 [n]) are read at replay."""

    def __init__(self, lib, host_rows, hot, src, dst, threads: int) -> None:
        n = src.numel()
        self.src, self.dst, self.hot, self.host_rows = src, dst, hot, host_rows
        self.idx = torch.empty(n, dtype=torch.int64, pin_memory=True)
        self.count = torch.empty(1, dtype=torch.int64, pin_memory=True)
        self.count_dev = torch.full((1,), n, dtype=torch.int64, device="cuda")
        self.staging = torch.empty((n, D), dtype=torch.uint8, pin_memory=True)
        self.landing = torch.empty((n, D), dtype=torch.uint8, device="cuda")
        self.job = _Job(
            host_rows.data_ptr(),
            self.idx.data_ptr(),
            self.count.data_ptr(),
            D,
            self.staging.data_ptr(),
            threads,
        )
        self.fn = ctypes.cast(lib.gather_job_run, ctypes.c_void_p)
        self.launch = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
        self.launch.argtypes = [ctypes.c_void_p] * 3
        self.launch.restype = ctypes.c_int
        self.graph = self._capture()

    def _steps(self) -> None:
        self.idx.copy_(self.src, non_blocking=True)
        self.count.copy_(self.count_dev, non_blocking=True)
        stream = torch.cuda.current_stream().cuda_stream
        rc = self.launch(stream, self.fn, ctypes.addressof(self.job))
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc returned {rc}")
        self.landing.copy_(self.staging, non_blocking=True)
        self.hot.index_copy_(0, self.dst, self.landing)

    def _capture(self) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._steps()  # eager once: the same path outside a graph
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._steps()
        return graph

    def checked_replay(self, g: torch.Generator) -> bool:
        """New host rows behind the same count, one replay, the rows compared."""
        rows = self.host_rows.shape[0]
        self.src.copy_(torch.randint(0, rows, (self.src.numel(),), generator=g))
        self.hot.zero_()
        self.graph.replay()
        torch.cuda.synchronize()
        pick = torch.randint(0, self.src.numel(), (64,), generator=g)
        want = self.host_rows[self.src.cpu()[pick]]
        return bool(torch.equal(self.hot[self.dst[pick.cuda()]].cpu(), want))


def run(args) -> dict:
    lib = native_library()
    if lib is None:
        raise SystemExit("host_node needs gcc for host_gather.c")
    pinned = measure_ceilings()["h2d_gbs"]
    tier = _Tier(args.tier_gib << 30)
    host_rows = tier.rows(D)
    host_rows[: 1 << 16].random_(0, 255)
    g = torch.Generator().manual_seed(38)
    src, dst = _compact(miss_lists(BS, RATE, 1 << 16, g))  # sources in the random rows
    hot = torch.zeros((BS * B, D), dtype=torch.uint8, device="cuda")
    gg = GraphGather(lib, host_rows, hot, src, dst, args.threads)
    ok = all(gg.checked_replay(g) for _ in range(3))
    nbytes = src.numel() * D
    ms = events_ms(gg.graph.replay, args.reps)
    x = torch.randn(BS, 7168, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(7168, 4096, dtype=torch.bfloat16, device="cuda")
    gemm = lambda: torch.mm(x, w)  # noqa: E731
    gemm_ms = _alone_ms(gemm, args.reps)
    repeat = max(1, round(1.5 * ms / gemm_ms))
    c, o = _together_ms(gg.graph.replay, gemm, repeat, args.reps)
    gbs, gbs_beside = nbytes / ms / 1e6, nbytes / c / 1e6
    print(f"pinned copy {pinned:.1f} GB/s; {nbytes >> 20} MiB a replay, rows ok: {ok}")
    print(f"graph alone      {1e3 * ms:8.1f} us  {gbs:5.1f} GB/s ({gbs / pinned:.2f} of pinned)")
    print(
        f"graph || gemm x{repeat} {1e3 * c:8.1f} us  {gbs_beside:5.1f} GB/s "
        f"({gbs_beside / pinned:.2f}); gemm {o / gemm_ms:.2f}x its time alone"
    )
    return {
        "device": torch.cuda.get_device_name(),
        "pinned_gb_per_s": pinned,
        "bytes": nbytes,
        "threads": args.threads,
        "rows_ok": ok,
        "graph_ms": ms,
        "beside_gemm_ms": c,
        "gemm_x": o / gemm_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=8, help="OpenMP threads of the host node")
    ap.add_argument("--tier-gib", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_node needs a GPU")
    report = run(args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

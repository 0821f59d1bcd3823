"""What bounds the miss copy alone on this machine: the host span it reads, how the host memory
was pinned, and runs of consecutive rows (issue 38 item 2).

Run AA1 (H100, docs/BENCHMARKS.md) timed the copy of a step's part (fp8 rows, bs 111, 13% of
k) alone at 21.5-22.4 GB/s (0.40 of the pinned copy) whatever its grid (8-48 CTAs, 4-32 warps)
and whatever SMs it had (16, 24 or 32 of its own, or all 132): a bound outside the SMs. On the
H200 (run I) the same copy alone reached 0.84. Candidates this tells apart:
- address translation: the GPU's (or the host IOMMU's) TLB misses on 4 KiB host pages
  scattered over a large tier. Then the rate falls with the span the sources lie in, and host
  memory pinned on huge pages (`thp`: anonymous memory advised MADV_HUGEPAGE, then
  cudaHostRegister; `hugetlb`: MAP_HUGETLB, where the host reserved any) reads faster than
  cudaHostAlloc's (`cuda`) or a registered /dev/shm file's (`shm`, the service's host tier);
- read requests in flight: the rate is requests in flight x bytes each / latency. Runs of R
  consecutive rows read R x 656 contiguous bytes: if only the request count matters, the rate
  does not move with R.

    python -m bench.kernels.copy_span [--spans 16,256,2048,8192] [--runs 1,4,16] \\
        [--allocs cuda,shm,thp,hugetlb] [--out PATH]

GPU only. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import tempfile
from pathlib import Path

import torch

from bench.kernels.miss_copy_cases import B, miss_lists
from bench.shared.timing import graph_time_us, measure_ceilings
from contract.file_mapping import CudaRegistrar
from kernels.swap.copy_grid import CopyGrid
from kernels.swap.miss_copy import miss_copy
from kernels.uva import UVATensor

_MAP_HUGETLB = 0x40000
REGISTRAR = CudaRegistrar(torch.device("cuda"))


def _registered(buf, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over `buf` (an mmap), its pages touched, then registered with CUDA as the
    service registers its host tier (contract.file_mapping)."""
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    t.fill_(1)  # fault every page in before the GPU maps them
    REGISTRAR.register(t.data_ptr(), nbytes)
    return t


def allocate(kind: str, nbytes: int) -> tuple[torch.Tensor, list]:
    """Pinned host bytes of `kind` and what keeps them alive (mmaps, files)."""
    if kind == "cuda":
        return torch.ones(nbytes, dtype=torch.uint8, pin_memory=True), []
    if kind == "shm":
        fd, path = tempfile.mkstemp(prefix="copy-span-", dir="/dev/shm")
        os.ftruncate(fd, nbytes)
        buf = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        os.close(fd)
        os.unlink(path)
        return _registered(buf, nbytes), [buf]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if kind == "hugetlb":
        buf = mmap.mmap(-1, nbytes, flags=flags | _MAP_HUGETLB)
    elif kind == "thp":
        buf = mmap.mmap(-1, nbytes, flags=flags)
        buf.madvise(mmap.MADV_HUGEPAGE)
    else:
        raise ValueError(f"unknown allocation {kind!r}")
    return _registered(buf, nbytes), [buf]


def case(host: torch.Tensor, d: int, span: int, run: int, args) -> dict:
    """The copy of one part's misses, sources in the first `span` bytes of `host`."""
    g = torch.Generator().manual_seed(span + run + d)
    rows = host[: host.numel() // d * d].view(-1, d)
    hot = torch.zeros((args.bs * B, d), dtype=torch.uint8, device="cuda")
    lists = miss_lists(args.bs, args.rate, span // d, g, run)
    grid = CopyGrid.parse(args.grid)
    uva = UVATensor(rows)
    us = graph_time_us(lambda: miss_copy(uva, hot, *lists, grid=grid))
    n = int(lists[2].sum())
    src, dst = lists[0][0, :8].cpu(), lists[1][0, :8]
    ok = bool(torch.equal(hot[dst].cpu(), rows[src]))
    return {
        "row_bytes": d,
        "span": span,
        "run": run,
        "rows": n,
        "us": us,
        "gb_per_s": n * d / us / 1e3,
        "bytes_ok": ok,
    }


def huge_pages_report() -> dict:
    out = {}
    for name in ("enabled", "shmem_enabled", "defrag"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError as e:
            out[name] = f"unreadable: {e}"
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    for line in meminfo:
        if line.startswith(("AnonHugePages", "ShmemHugePages", "HugePages_Total", "Hugepagesize")):
            key, value = line.split(":", 1)
            out[key] = value.strip()
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--spans", default="16,256,2048,8192", help="MiB the sources lie in")
    ap.add_argument("--runs", default="1,4,16", help="consecutive rows a miss run holds")
    ap.add_argument("--row-bytes", default="656,1152")
    ap.add_argument("--allocs", default="cuda,shm,thp,hugetlb")
    ap.add_argument("--bs", type=int, default=111)
    ap.add_argument("--rate", type=float, default=0.13)
    ap.add_argument("--grid", default="64", help="the copy's CopyGrid spec")
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args()


def cases_of(kind: str, spans: list[int], ceiling: float, args, report: dict) -> None:
    """Every (row width, span, run) over host memory pinned as `kind`, printed and kept."""
    try:
        host, keep = allocate(kind, max(spans))
    except (OSError, RuntimeError, ValueError) as e:
        print(f"{kind:<8} unavailable: {e}")
        report["cases"].append({"alloc": kind, "error": str(e)})
        return
    report[f"huge_pages_{kind}"] = huge_pages_report()
    for d in (int(x) for x in args.row_bytes.split(",")):
        for span in spans:
            for run in (int(r) for r in args.runs.split(",")):
                row = {"alloc": kind, **case(host, d, span, run, args)}
                report["cases"].append(row)
                print(
                    f"{kind:<8} {d:>6} {span >> 20:>9} {run:>4} {row['us']:>9.1f} "
                    f"{row['gb_per_s']:>6.1f} {row['gb_per_s'] / ceiling:>5.2f}"
                    f"{'' if row['bytes_ok'] else '  BYTES WRONG'}",
                    flush=True,
                )
    if kind != "cuda":
        REGISTRAR.unregister(host.data_ptr())
    del host, keep


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("copy_span needs a GPU")
    spans = [int(s) << 20 for s in args.spans.split(",")]
    ceiling = measure_ceilings()["h2d_gbs"]
    report = {
        "device": torch.cuda.get_device_name(),
        "pinned_gb_per_s": ceiling,
        "huge_pages_before": huge_pages_report(),
        "cases": [],
    }
    print(f"{report['device']}: pinned copy {ceiling:.1f} GB/s; {report['huge_pages_before']}")
    print(f"{'alloc':<8} {'row B':>6} {'span MiB':>9} {'run':>4} {'us':>9} {'GB/s':>6} {'/pin':>5}")
    for kind in args.allocs.split(","):
        cases_of(kind, spans, ceiling, args, report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

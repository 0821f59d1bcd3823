"""Can the miss copy get SMs of its own? A probe of CUDA green contexts (issue 38 item 2).

The copy sweeps (docs/BENCHMARKS.md, run U) found the copy's cost to the step nearly flat in its
grid: moving it from 64 SMs onto 4-12 saved 0.2 of 2.4 ms. One suspect is that the side-stream
copy and the main stream share every SM: each layer's copy launch waits for room behind the
resident CTAs of the main stream's kernels, and the main stream's CTAs land beside the copy's.
A green context partitions the SMs, so a stream of one runs only on its own. This probe asks
the questions that decide whether the engine can use it, on the device it runs on:

1. does this torch expose green contexts and a stream of one;
2. which SMs a green stream's CTAs run on (`%smid`), launched eagerly and from a CUDA graph
   captured across the main stream and the green one (the engine replays graphs);
3. whether the two groups of kernels/sm_partition.py's split (the copy's P SMs, the rest) are
   disjoint;
4. the copy (fp8 rows, bs 111, 13% misses) alone, and beside a neighbour (memory-bound passes
   and GEMMs) on the main stream, with the copy on a plain stream, on the small group, and with
   the neighbour on the rest.

    python -m bench.kernels.sm_partition [--sms 8,16] [--grids 8@64Kx32,24] [--out PATH]

Prints what it finds and writes JSON. GPU only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import kernels.interpreter  # noqa: F401  (the interpreter switch, before import triton)

# isort: split
import torch
import triton
import triton.language as tl

from bench.kernels.miss_copy_cases import _Tier, miss_lists
from bench.shared.timing import graph_time_us
from kernels.sm_partition import SmPartition, split_sms
from kernels.swap.copy_grid import CopyGrid
from kernels.swap.miss_copy import miss_copy
from kernels.uva import UVATensor


@triton.jit
def _smid_kernel(out_ptr):
    sm = tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )
    # Hold the SM a moment, so the CTAs spread over every SM the stream may use.
    t0 = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    t = t0
    while t - t0 < 20000:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    tl.store(out_ptr + tl.program_id(0), sm)


def _sms_of(launch) -> list[int]:
    """The distinct SMs that launch(out) ran 4 x 132 one-warp CTAs on."""
    out = torch.full((528,), -1, dtype=torch.int32, device="cuda")
    launch(out)
    torch.cuda.synchronize()
    return sorted(set(out.tolist()))


def _smid(out: torch.Tensor) -> None:
    _smid_kernel[(out.numel(),)](out, num_warps=1)


def _graphed(side: torch.cuda.Stream, fn):
    """A graph captured on a plain stream that forks fn onto `side` and joins it, replayed."""
    main = torch.cuda.Stream()

    def launch(out):
        fn(out)  # compiles outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(main):
            with torch.cuda.graph(g, stream=main):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    fn(out)
                main.wait_stream(side)
        out.fill_(-1)
        g.replay()

    return launch


def _placement(report: dict, sms_list: list[int]) -> dict[int, SmPartition]:
    parts = {}
    for p in sms_list:
        try:
            part = split_sms(p)
        except Exception as e:  # noqa: BLE001 (the probe reports what the driver refuses)
            report[f"split {p}"] = f"failed: {type(e).__name__}: {e}"
            print(report[f"split {p}"])
            continue
        parts[p] = part
        entry: dict = {"sms": part.sms, "rest_sms": part.rest_sms}
        for name, stream in (("small", part.small), ("rest", part.rest)):

            def on(out, s=stream):
                with torch.cuda.stream(s):
                    _smid(out)

            entry[name] = _try(lambda: _sms_of(on))
            entry[name + " graph"] = _try(lambda: _sms_of(_graphed(stream, _smid)))
        small, rest = entry["small"], entry["rest"]
        if isinstance(small, list) and isinstance(rest, list):
            entry["overlap"] = sorted(set(small) & set(rest))
        report[f"split {p}"] = entry
        print(f"split {p}: " + ", ".join(f"{k} {_short(v)}" for k, v in entry.items()))
    return parts


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return f"failed: {type(e).__name__}: {e}"


def _short(sms) -> str:
    if not isinstance(sms, list) or not sms:
        return str(sms)
    return f"{len(sms)} SMs {sms[:3]}..{sms[-2:]}"


def _copy_case(tier: _Tier, spec: str):
    g = torch.Generator().manual_seed(0)
    host = tier.rows(656)
    hot = torch.zeros((111 * 4096, 656), dtype=torch.uint8, device="cuda")
    lists = miss_lists(111, 0.13, host.shape[0], g)
    uva = UVATensor(host)
    grid = CopyGrid.parse(spec)
    nbytes = int(lists[2].sum()) * 656
    return (lambda: miss_copy(uva, hot, *lists, grid=grid)), nbytes


def _timings(parts: dict[int, SmPartition], copy, nbytes: int) -> dict:
    """The copy and its neighbour alone and together, on shared SMs and on each partition."""
    big = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")

    def neighbour():  # memory-bound passes and a GEMM, as between two layers' copies
        for _ in range(4):
            big.mul_(1.0001)
            a.matmul(a)

    rows = {"neighbour alone": graph_time_us(neighbour), "copy alone": graph_time_us(copy)}
    rows["both, plain side stream"] = _pair_us(neighbour, copy, torch.cuda.Stream())
    for p, part in parts.items():
        for key, fn in (
            (f"copy alone, small {part.sms}", lambda: _on_us(copy, part.small)),
            (f"neighbour alone, rest {part.rest_sms}", lambda: _on_us(neighbour, part.rest)),
            (f"both, copy small {part.sms}", lambda: _pair_us(neighbour, copy, part.small)),
            (
                f"both, copy small {part.sms}, neighbour rest",
                lambda: _pair_us(neighbour, copy, part.small, main=part.rest),
            ),
        ):
            rows[key] = _try(fn)
    for k, us in rows.items():
        gbs = (
            f"  copy {nbytes / us / 1e3:6.1f} GB/s"
            if "copy alone" in k and not isinstance(us, str)
            else ""
        )
        print(f"  {k:<48} {us if isinstance(us, str) else f'{us:9.1f} us'}{gbs}")
    return rows


def _on_us(fn, stream) -> float:
    def launch():  # forked from the capturing stream and joined back, as a capture requires
        cur = torch.cuda.current_stream()
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            fn()
        cur.wait_stream(stream)

    return graph_time_us(launch)


def _pair_us(neighbour, copy, side, main=None) -> float:
    """The neighbour on the (main) stream and the copy forked onto `side`, in one graph."""

    def both():
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            copy()
        neighbour()
        cur.wait_stream(side)

    if main is None:
        return graph_time_us(both)
    return _on_us(both, main)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sms", default="8,16", help="the copy's green-context SM counts")
    ap.add_argument(
        "--grids",
        default="8@64Kx32",
        help="the copy's launches, comma-separated CopyGrid specs (without gSMS): each is timed "
        "alone and beside the neighbour, on shared SMs and on each partition",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sm_partition needs a GPU")
    from torch.cuda import green_contexts

    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "green_supported": green_contexts.SUPPORTED,
        "has_stream": hasattr(green_contexts.GreenContext, "Stream"),
    }
    print(report)
    report["plain"] = _sms_of(_smid)
    print(f"plain stream: {_short(report['plain'])}")
    parts = _placement(report, [int(s) for s in args.sms.split(",")])
    tier = _Tier(1 << 30)
    report["timings_us"] = {}
    for spec in args.grids.split(","):
        print(f"copy grid {spec}:")
        copy, nbytes = _copy_case(tier, spec)
        report["timings_us"][spec] = _timings(parts, copy, nbytes)
        report["copy_bytes"] = nbytes
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()

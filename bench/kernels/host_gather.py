"""A part's misses moved by the copy engine instead of SM loads (issue 38 item 2: "not the copy
engines, unless a measurement of ours says otherwise").

Run AE: the SM copy of a part's misses alone runs at ~0.47 of a pinned copy on the engine's grid
and drops to 0.19-0.32 beside the model's kernels, which it slows in turn; per layer the copies
(~1.54 ms) outlast the model work beside them (~0.84 ms). Here no SM reads host memory: the
host gathers the part's miss rows into pinned staging with its own threads, chunk by chunk, the
DMA engine moves each chunk while the host gathers the next, and one device scatter puts the
rows in their hot slots. The price is a host round trip: the miss list comes down and the
gather waits on it (the list's compaction on the device is not timed here; the engine's plan
would have to write it compact).

    python -m bench.kernels.host_gather [--threads 4,8,16] [--chunks 1,4,8]
        [--gathers torch,native] [--out PATH]

For fp8 rows at bs 111 and 13% misses (a step's part, as bench/kernels/beside_cases.py):
- `sm copy`: the engine's side-stream miss copy (its overlap grid), alone and beside a GEMM and
  the mix pass on the main stream (each neighbour's time a launch beside it against alone);
- `dma G Tt xC`: wall time from the list ready on the device to the rows in place, T gather
  threads, C chunks, gathered by torch's index_select or by the engine's gather
  (kernels/swap/host_gather.c, OpenMP; skipped where it does not build); its parts (list
  down, gather, the tail after the last gather); the same beside the same neighbours. GPU
  only; prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.kernels.beside_cases import BS, RATE, _alone_ms, _neighbours, _together_ms
from bench.kernels.miss_copy_cases import B, K, _copy_fn, _Tier, miss_lists
from bench.shared.timing import Row, events_ms, measure_ceilings, print_table

D = 656  # V3.2's fp8 rows


class DmaCopy:
    """Host gather into pinned staging, chunked DMA copies, one device scatter: the misses
    without SM loads from host memory."""

    def __init__(self, host_rows: torch.Tensor, hot: torch.Tensor, max_rows: int) -> None:
        self.host_rows, self.hot = host_rows, hot
        self.gather = lambda idx, out: torch.index_select(host_rows, 0, idx, out=out)
        self.staging = torch.empty((max_rows, D), dtype=torch.uint8, pin_memory=True)
        self.landing = torch.empty((max_rows, D), dtype=torch.uint8, device=hot.device)
        self.idx = torch.empty(max_rows, dtype=torch.int64, pin_memory=True)
        self.stream = torch.cuda.Stream()
        self.listed, self.done = torch.cuda.Event(), torch.cuda.Event()

    def run(self, src: torch.Tensor, dst: torch.Tensor, chunks: int) -> dict:
        """Move rows host_rows[src] to hot[dst] (both compact, on the device); returns the
        host seconds of each part. The caller waits on `done`."""
        n = src.numel()
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            self.idx[:n].copy_(src, non_blocking=True)
            self.listed.record()
        self.listed.synchronize()
        t1 = time.perf_counter()
        bounds = [n * i // chunks for i in range(chunks + 1)]
        for a, b in zip(bounds, bounds[1:]):
            self.gather(self.idx[a:b], self.staging[a:b])
            with torch.cuda.stream(self.stream):
                self.landing[a:b].copy_(self.staging[a:b], non_blocking=True)
        t2 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            self.hot.index_copy_(0, dst, self.landing[:n])
            self.done.record()
        return {"list_ms": 1e3 * (t1 - t0), "gather_ms": 1e3 * (t2 - t1), "t0": t0}

    def timed(self, src, dst, chunks: int) -> dict:
        parts = self.run(src, dst, chunks)
        self.done.synchronize()
        parts["wall_ms"] = 1e3 * (time.perf_counter() - parts.pop("t0"))
        parts["tail_ms"] = parts["wall_ms"] - parts["list_ms"] - parts["gather_ms"]
        return parts


def native_gather(host_rows: torch.Tensor, threads: int):
    """The engine's host gather (kernels/swap/host_gather.c) as fn(idx, out): one list of
    idx.numel() rows; None (and why, printed) where it does not build."""
    from kernels.swap import host_gather

    try:
        host_gather.library()
    except host_gather.HostGatherUnavailable as e:
        print(f"native gather unavailable: {e}")
        return None

    def gather(idx: torch.Tensor, out: torch.Tensor) -> None:
        count = torch.tensor([idx.numel()], dtype=torch.int32)
        host_gather.host_gather(host_rows, idx.view(1, -1), count, out, threads=threads)

    return gather


def _median_parts(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _beside(dma: DmaCopy, src, dst, chunks: int, other, repeat: int, reps: int) -> tuple:
    """(dma wall ms, other's ms a launch): `repeat` launches of `other` queued on the main
    stream, then the gather on the host while they run."""
    walls, others = [], []
    for _ in range(reps + 1):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        torch.cuda.synchronize()
        ev[0].record()
        for _ in range(repeat):
            other()
        ev[1].record()
        walls.append(dma.timed(src, dst, chunks)["wall_ms"])
        torch.cuda.synchronize()
        others.append(ev[0].elapsed_time(ev[1]) / repeat)
    return statistics.median(walls[1:]), statistics.median(others[1:])


def _compact(lists) -> tuple[torch.Tensor, torch.Tensor]:
    src, dst, counts = lists
    live = torch.arange(K, device=src.device)[None, :] < counts[:, None].long()
    return src[live].contiguous(), dst[live].contiguous()


def _rate(nbytes: int, ms: float, pinned: float) -> str:
    gbs = nbytes / ms / 1e6
    return f"{gbs:.1f} GB/s ({gbs / pinned:.2f} of pinned)"


def beside_rows(name, copy, nbytes, pinned, neighbours, one, reps) -> tuple[list[Row], dict]:
    """`copy` alone, then beside each neighbour on the main stream: repeats enough launches of
    it to cover the copy (sized by `one`, each neighbour's ms for one launch), and times it
    alone over the same back-to-back launches (one launch from an idle device carries its
    launch gap: run AF read the neighbours as faster beside the copy than alone). The table's
    rows and {"ms", "beside": {neighbour: {"ms", "repeat", "alone_ms", "other_x"}}}."""
    ms = events_ms(copy, reps)
    rows = [Row(name, f"alone {nbytes >> 20} MiB", 1e3 * ms, 1.0, _rate(nbytes, ms, pinned))]
    entry: dict = {"ms": ms, "beside": {}}
    for other, fn in neighbours.items():
        repeat = max(1, round(1.5 * ms / one[other]))
        alone = _alone_ms(fn, reps, repeat)
        c, o = _together_ms(copy, fn, repeat, reps)
        x = o / alone
        entry["beside"][other] = {"ms": c, "repeat": repeat, "alone_ms": alone, "other_x": x}
        note = f"{_rate(nbytes, c, pinned)}; {other} {x:.2f}x its time alone"
        rows.append(Row(name, f"|| {other} x{repeat}", 1e3 * c, ms / c, note))
    return rows, entry


def _dma_rows(dma, src, dst, how: tuple, ctx) -> tuple[list[Row], dict]:
    """One (gather, threads, chunks) point of the DMA path alone and beside each neighbour."""
    neighbours, alone, repeats, nbytes, pinned, sm_ms, reps = ctx
    gather, threads, chunks = how
    torch.set_num_threads(threads)
    if gather == "native":
        dma.gather = native_gather(dma.host_rows, threads)
        if dma.gather is None:
            return [], {}
    else:
        dma.gather = lambda idx, out: torch.index_select(dma.host_rows, 0, idx, out=out)
    dma.hot.zero_()
    torch.cuda.synchronize()  # the side stream does not wait on the main stream's zeroing
    parts = _median_parts([dma.timed(src, dst, chunks) for _ in range(reps + 1)][1:])
    ok = bool(torch.equal(dma.hot[dst[:64]].cpu(), dma.host_rows[src[:64].cpu()]))
    label = f"dma {gather} {threads}t x{chunks}"
    note = (
        f"{_rate(nbytes, parts['wall_ms'], pinned)}; list {parts['list_ms']:.3f} gather "
        f"{parts['gather_ms']:.3f} tail {parts['tail_ms']:.3f} ms{'' if ok else ' BYTES WRONG'}"
    )
    rows = [Row(label, "alone", 1e3 * parts["wall_ms"], sm_ms / parts["wall_ms"], note)]
    entry = {"gather": gather, "threads": threads, "chunks": chunks, "bytes_ok": ok, **parts}
    entry["beside"] = {}
    for name, fn in neighbours.items():
        w, o = _beside(dma, src, dst, chunks, fn, repeats[name], reps)
        entry["beside"][name] = {"wall_ms": w, "other_x": o / alone[name]}
        note = f"{_rate(nbytes, w, pinned)}; {name} {o / alone[name]:.2f}x its time alone"
        rows.append(Row(label, f"|| {name} x{repeats[name]}", 1e3 * w, sm_ms / w, note))
    return rows, entry


def cases(args) -> tuple[list[Row], dict]:
    pinned = measure_ceilings()["h2d_gbs"]
    tier = _Tier(args.tier_gib << 30)
    host_rows = tier.rows(D)
    lists = miss_lists(BS, RATE, host_rows.shape[0], torch.Generator().manual_seed(38))
    hot = torch.zeros((BS * B, D), dtype=torch.uint8, device="cuda")
    src, dst = _compact(lists)
    # the rows the check reads: random bytes (the tier is random only in its first 64 MiB)
    host_rows[src[:64].cpu()] = torch.randint(0, 255, (64, D), dtype=torch.uint8)
    nbytes = src.numel() * D
    from engine_client.kv.hisparse import OVERLAP_COPY_GRID

    sm = _copy_fn(host_rows, hot, lists, grid=OVERLAP_COPY_GRID)
    neighbours = {k: v for k, v in _neighbours().items() if k in ("gemm", "mix pass")}
    one = {name: _alone_ms(fn, args.reps) for name, fn in neighbours.items()}
    rows, entry = beside_rows("sm copy", sm, nbytes, pinned, neighbours, one, args.reps)
    sm_ms = entry["ms"]
    # The DMA path beside each neighbour over the SM copy's launches, against the same alone.
    repeats = {name: b["repeat"] for name, b in entry["beside"].items()}
    alone = {name: b["alone_ms"] for name, b in entry["beside"].items()}
    dma = DmaCopy(host_rows, hot, src.numel())
    report = {"pinned_gb_per_s": pinned, "bytes": nbytes, "sm_ms": sm_ms, "dma": []}
    ctx = (neighbours, alone, repeats, nbytes, pinned, sm_ms, args.reps)
    points = [
        (g, int(t), int(c))
        for g in args.gathers.split(",")
        for t in args.threads.split(",")
        for c in args.chunks.split(",")
    ]
    for how in points:
        more, entry = _dma_rows(dma, src, dst, how, ctx)
        rows += more
        report["dma"].append(entry)
    return rows, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", default="4,8,16", help="host threads gathering (torch intra-op)")
    ap.add_argument("--chunks", default="1,4,8", help="gather/DMA chunks a part")
    ap.add_argument("--gathers", default="torch,native", help="torch's index_select, host_gather.c")
    ap.add_argument("--tier-gib", type=int, default=4, help="pinned host tier the rows lie in")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_gather needs a GPU")
    rows, report = cases(args)
    print_table(rows)
    report["device"] = torch.cuda.get_device_name()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

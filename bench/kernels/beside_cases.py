"""The miss copy beside one other kernel at a time (issue 38 item 2's controlled experiments).

In the fp8 step the copy runs at ~0.5 of a pinned copy against ~0.8 alone, and its neighbours
slow down (runs J, AC, AD); giving it SMs of its own changed nothing (run W), so the shared
resource is outside the SMs. This case tells which kind of neighbour costs the copy its rate and
which neighbour the copy slows: the engine's side-stream copy (fp8 rows, bs 111, 13% misses, the
overlap grid) on a side stream, one kernel repeated on the main stream long enough to cover it:
- hbm stream: a 512 MiB device-to-device copy (HBM-bound, the GEMMs' and attention's resource);
- l2 elementwise: an add over 16 MiB (L2-resident, many small CTAs);
- gemm: bs 111 x 7168 by a 7168 x 4096 bf16 weight (weight-read-bound, as the step's GEMMs);
- score pass / mix pass: the two-pass attention's kernels at the launch table's entry.
Each row: the copy's time and rate beside the kernel (ratio: its rate over its rate alone), and
the kernel's time a launch beside the copy against alone, both over the same back-to-back
launches (in the note). Events on both streams, not graphs, so each side's duration is its own;
medians over the repetitions.
"""

from __future__ import annotations

import statistics

import torch

from bench.kernels.attention_cases import inputs
from bench.kernels.kernel_cases import B, H, K
from bench.kernels.miss_copy_cases import _copy_fn, _Tier, miss_lists
from bench.shared.timing import Row, events_ms

BS, RATE = 111, 0.13


def _neighbours() -> dict:
    """name -> a launch of the kernel (inputs made once)."""
    from kernels.attention.configs import launch_config
    from kernels.attention.sparse import TileWorkspace, mix_pass, score_pass
    from kernels.formats import FP8_ROW

    big = torch.empty(256 << 20, dtype=torch.uint16, device="cuda")
    big_to = torch.empty_like(big)
    small = torch.zeros(4 << 20, dtype=torch.float32, device="cuda")
    x = torch.randn(BS, 7168, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(7168, 4096, dtype=torch.bfloat16, device="cuda")
    q, qp, kv, base, slots = inputs(BS, "fp8")
    ws = TileWorkspace.allocate(BS, H, K, row_format=FP8_ROW, device="cuda")
    cfg = launch_config(FP8_ROW, BS)
    out = torch.empty((BS, H, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((BS, H), dtype=torch.float32, device="cuda")
    score = lambda: score_pass(q, qp, kv, base, slots, 0.06, ws, cfg, FP8_ROW)  # noqa: E731
    score()  # the mix pass reads the score pass's tiles
    return {
        "hbm stream": lambda: big_to.copy_(big),
        "l2 elementwise": lambda: small.add_(1.0),
        "gemm": lambda: torch.mm(x, w),
        "score pass": score,
        "mix pass": lambda: mix_pass(kv, base, slots, out, lse, ws, cfg, FP8_ROW),
    }


def _alone_ms(fn, reps: int, repeat: int = 1) -> float:
    """ms a launch of fn, `repeat` launches back to back between two events: the neighbour
    alone is timed as it runs beside the copy (run AE timed one launch from an idle device,
    ~1.5x its Nsight time, and read the neighbours as faster beside the copy than alone)."""
    fn()  # compile and warm up

    def launches() -> None:
        for _ in range(repeat):
            fn()

    return events_ms(launches, reps) / repeat


def _together_ms(copy, other, repeat: int, reps: int) -> tuple[float, float]:
    """(copy ms, other's ms a launch) with the copy on a side stream and `repeat` launches of
    the other kernel on the main stream, started together."""
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    copy_ms, other_ms = [], []
    for _ in range(reps + 1):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            ev[0].record()
            copy()
            ev[1].record()
        ev[2].record()
        for _ in range(repeat):
            other()
        ev[3].record()
        main.wait_stream(side)
        torch.cuda.synchronize()
        copy_ms.append(ev[0].elapsed_time(ev[1]))
        other_ms.append(ev[2].elapsed_time(ev[3]) / repeat)
    return statistics.median(copy_ms[1:]), statistics.median(other_ms[1:])


def copy_beside_case(ceil: dict, reps: int) -> list[Row]:
    d = 656  # V3.2's fp8 rows
    tier = _Tier(4 << 30)
    g = torch.Generator().manual_seed(38)
    lists = miss_lists(BS, RATE, tier.flat.numel() // d, g)
    hot = torch.zeros((BS * B, d), dtype=torch.uint8, device="cuda")
    from engine_client.kv.hisparse import OVERLAP_COPY_GRID

    copy = _copy_fn(tier.rows(d), hot, lists, grid=OVERLAP_COPY_GRID)
    nbytes = int(lists[2].sum()) * d  # lists: sources, destinations, counts per request
    alone = _alone_ms(copy, reps)
    pinned = ceil["h2d_gbs"]
    rows = [
        Row(
            "beside",
            f"copy alone {nbytes >> 20} MiB",
            1e3 * alone,
            1.0,
            _rate(nbytes, alone, pinned),
        )
    ]
    for name, other in _neighbours().items():
        repeat = max(1, round(1.5 * alone / _alone_ms(other, reps)))
        other_alone = _alone_ms(other, reps, repeat)
        c, o = _together_ms(copy, other, repeat, reps)
        note = (
            f"{_rate(nbytes, c, pinned)}; {name} {1e3 * o:.1f} us a launch beside the copy, "
            f"{1e3 * other_alone:.1f} alone ({o / other_alone:.2f}x)"
        )
        rows.append(Row("beside", f"copy || {name} x{repeat}", 1e3 * c, alone / c, note))
    del tier
    return rows


def _rate(nbytes: int, ms: float, pinned: float) -> str:
    gbs = nbytes / ms / 1e6
    return f"copy {gbs:.1f} GB/s ({gbs / pinned:.2f} of pinned)"


ALL = [copy_beside_case]

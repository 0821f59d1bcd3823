"""Why 656-byte rows copy slower than 1152-byte rows (issue 30), in bench/kernels.py.

Run I measured the copy of 8-row tiles (64 CTAs: ~336 KB of 656-byte rows in flight against
~590 KB of 1152-byte rows); since issue 38 a CTA moves a power-of-two count of 16-byte vectors
over consecutive rows (chunk_bytes) whatever the row width. Candidates, each timed on the same
miss lists (bs 128, 13% of k, 4 GiB host tier), GB/s counted on the 656 useful bytes:
- geometry at 64 CTAs and the default grid: chunks of 4 / 8 / 16 / 32 KiB, 4 or 8 warps (a dense
  power-of-two head tile + tail tile per row was measured in run I and dropped:
  docs/DECISIONS.md);
- host layouts with aligned copy units: rows padded to 768 B (6 x 128 B, +17% bytes moved), and
  the 512-byte fp8 block and the 144-byte scales + rope tail in two arrays (two launches).
A 1152-byte row is 9 x 128 B, so its rows start on a 128-byte line; a 656-byte row (5 x 128 +
16) starts on one only every 8th row and touches 6 lines for 5.1 lines of bytes.
"""

from __future__ import annotations

import torch

from bench.miss_copy_cases import HOST_TIER_BYTES, POISON, B, _case, _Tier, miss_lists
from bench.timing import Row, graph_time_us
from kernels.uva import UVATensor

BS, RATE = 128, 0.13
SIDE_GRID = 64  # the launch of engine_client.kv.hisparse.OVERLAP_COPY_GRID
GEOMETRY = [
    (chunk, warps, programs)
    for programs in (SIDE_GRID, None)
    for chunk, warps in ((4096, 4), (8192, 4), (16384, 4), (16384, 8), (32768, 8))
]


def _geometry_rows(tier: _Tier, ceil: dict, reps: int) -> list[Row]:
    out = []
    for d in (656, 1152):
        for chunk, warps, programs in GEOMETRY:
            grid = f"{programs} CTAs" if programs else "default grid"
            kw = dict(chunk_bytes=chunk, num_warps=warps, programs=programs)
            label = f"chunk{chunk >> 10}K w{warps} {grid}"
            out.append(_case(tier, BS, RATE, d, ceil, reps, label=label, **kw))
    return out


def _split_copy(tier: _Tier, widths: tuple[int, ...], programs: int | None, reps: int):
    """One miss list copied as len(widths) arrays of rows `widths` bytes wide, one launch each;
    the arrays share the tier's bytes (each starts on a 1 MiB boundary of its own part)."""
    from kernels.swap.miss_copy import miss_copy

    g = torch.Generator().manual_seed(BS * 1000 + int(RATE * 100) + 656)
    part = HOST_TIER_BYTES // len(widths) >> 20 << 20
    hosts = [
        tier.flat[i * part : i * part + part // w * w].view(-1, w) for i, w in enumerate(widths)
    ]
    n_rows = min(h.shape[0] for h in hosts)
    lists = miss_lists(BS, RATE, n_rows, g)
    hots = [torch.full((BS * B, w), POISON, dtype=torch.uint8, device="cuda") for w in widths]
    uvas = [UVATensor(h) for h in hosts]

    def run() -> None:
        for uva, hot in zip(uvas, hots):
            miss_copy(uva, hot, *lists, programs=programs)

    return graph_time_us(run, reps), int(lists[2].sum())


def _layout_rows(tier: _Tier, ceil: dict, reps: int) -> list[Row]:
    out = []
    for label, widths in (
        ("656B as one 656B array", (656,)),
        ("656B padded to 768B", (768,)),
        ("656B as 512B + 144B arrays", (512, 144)),
        ("656B as 512B + 160B arrays", (512, 160)),
    ):
        for programs in (SIDE_GRID, None):
            us, n = _split_copy(tier, widths, programs, reps)
            gbs = n * 656 / us / 1e3
            moved = sum(widths) / 656
            grid = f"{programs} CTAs" if programs else "default grid"
            out.append(
                Row(
                    "copy_layout",
                    f"bs{BS} {RATE:.0%} {label} {grid}",
                    us,
                    gbs / ceil["h2d_gbs"],
                    f"{n} rows, {gbs:.1f} GB/s of 656 B rows ({moved:.2f}x bytes moved); "
                    f"{len(widths)} launch(es)",
                )
            )
    return out


def copy_layout_case(ceil: dict, reps: int) -> list[Row]:
    tier = _Tier(HOST_TIER_BYTES)
    rows = _geometry_rows(tier, ceil, reps) + _layout_rows(tier, ceil, reps)
    del tier
    return rows


ALL = [copy_layout_case]

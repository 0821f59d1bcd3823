"""Copy/compute overlap and the in-situ miss copy, kernel level (issue 23, items 1 and 3).

- tier: the same miss lists (bs 128, 13% of k) with sources spread over 256 MiB, 4 GiB and
  16 GiB of pinned host memory. The engine's host tier at 32K x 174 requests is ~26 GB, far
  above what the kernel benchmark used (4 GiB): if the copy slows with the span its sources
  cover, address translation of host memory (not the copy kernel) is the in-situ loss.
- concurrent: the score pass of the attention (the work that split attention can run while the
  misses stream in: tiles of resident rows need no copied row) and the miss copy on a side
  stream with the overlap grid (OVERLAP_COPY_GRID), alone and together, in one graph.
  hidden = (copy + score - together) / copy: the share of the copy that overlap removes.
"""

from __future__ import annotations

import torch

from bench.attention_cases import inputs
from bench.kernel_cases import B, H, K
from bench.miss_copy_cases import _case, _copy_fn, _Tier, miss_lists
from bench.timing import Row, graph_time_us

TIER_SPANS = (256 << 20, 4 << 30, 16 << 30)


def copy_tier_case(ceil: dict, reps: int) -> list[Row]:
    from kernels.formats import ROW_FORMATS

    tier, rows = _Tier(TIER_SPANS[-1]), []
    for d in (f.row_bytes for f in ROW_FORMATS.values()):
        for span in TIER_SPANS:
            rows.append(_case(tier, 128, 0.13, d, ceil, reps, span, f"src over {span >> 20}MiB"))
    del tier
    return rows


def _score_fn(bs: int, fmt: str):
    from kernels.attention.configs import launch_config
    from kernels.attention.sparse import TileWorkspace, score_pass
    from kernels.formats import ROW_FORMATS

    q, qp, kv, base, slots = inputs(bs, fmt)
    row_format = ROW_FORMATS[fmt]
    ws = TileWorkspace.allocate(bs, H, K, row_format=row_format, device="cuda")
    cfg = launch_config(row_format, bs)
    return lambda: score_pass(q, qp, kv, base, slots, 0.06, ws, cfg, row_format)  # noqa: E731


def concurrent_case(ceil: dict, reps: int) -> list[Row]:
    from engine_client.kv.hisparse import OVERLAP_COPY_GRID
    from kernels.formats import ROW_FORMATS

    rows = []
    tier = _Tier(4 << 30)
    for fmt, row_format in ROW_FORMATS.items():
        bs, d = 128, row_format.row_bytes
        g = torch.Generator().manual_seed(7)
        lists = miss_lists(bs, 0.13, tier.flat.numel() // d, g)
        hot = torch.zeros((bs * B, d), dtype=torch.uint8, device="cuda")
        copy = _copy_fn(tier.rows(d), hot, lists, grid=OVERLAP_COPY_GRID)
        full_copy = _copy_fn(tier.rows(d), hot, lists)
        score = _score_fn(bs, fmt)
        side = torch.cuda.Stream()

        def together() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copy()  # noqa: B023
            score()  # noqa: B023
            torch.cuda.current_stream().wait_stream(side)

        c, f, s, t = (graph_time_us(fn, reps) for fn in (copy, full_copy, score, together))
        rows.append(
            Row(
                "overlap",
                f"bs{bs} 13% {d}B copy || score pass",
                t,
                (c + s - t) / c,
                f"hidden share of the copy (ratio col); copy {c:.1f}us with "
                f"grid {OVERLAP_COPY_GRID.label()} ({f:.1f}us full grid), score pass {s:.1f}us, "
                f"serial sum {c + s:.1f}us",
            )
        )
    del tier
    return rows


ALL = [copy_tier_case, concurrent_case]

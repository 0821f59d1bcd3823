"""Miss-copy cases of bench/kernels/cli.py shaped like a decode step (issue 16).

In a step every request of the batch brings its own short miss list (a few percent of k = 2048
rows, scattered over a large host tier), where the bulk case of kernel_cases copies 64 long
lists from a small one. Each case is timed against the same run's pinned copy: the 1 GiB
ceiling (the target's reference) and a contiguous pinned copy of the same bytes.
"""

from __future__ import annotations

import torch

from bench.shared.timing import Row, graph_time_us
from kernels.uva import UVATensor

K, B = 2048, 4096
BATCHES = (64, 128, 256)
MISS_RATES = (0.0, 0.05, 0.13, 0.20)
ROW_BYTES = (1152, 656)
HOST_TIER_BYTES = 4 << 30
SMALL_TIERS = (256 << 20, 16 << 20)
POISON = 0xA5
# (label, miss_copy keywords): tuning variants at one in-situ point.
VARIANTS = [
    ("chunk8K w4 default grid", {}),
    ("chunk16K w4", dict(chunk_bytes=16384)),
    ("chunk16K w8", dict(chunk_bytes=16384, num_warps=8)),
    ("chunk8K w4 2/SM", dict(programs_per_sm=2)),
    ("chunk8K w4 4/SM", dict(programs_per_sm=4)),
    ("chunk8K w4 16/SM", dict(programs_per_sm=16)),
    # Few CTAs: how small a grid still moves PCIe's worth (the side-stream copy
    # that overlaps compute should leave the other SMs to the compute).
    ("chunk8K w4 16 CTAs", dict(programs=16)),
    ("chunk16K w4 32 CTAs", dict(programs=32, chunk_bytes=16384)),
    ("chunk8K w4 66 CTAs", dict(programs=66)),
    ("chunk8K w4 132 CTAs", dict(programs=132)),
]


def miss_lists(
    bs: int, rate: float, host_rows: int, g: torch.Generator, run: int = 1, device: str = "cuda"
):
    """Per request ~rate * k misses (uniform in [0.5, 1.5] x the mean, a multiple of `run`),
    sources anywhere in the host tier's first host_rows in runs of `run` consecutive rows,
    destinations distinct in the request's own B hot slots."""
    mean = rate * K
    counts = (mean * (0.5 + torch.rand(bs, generator=g))).round().clamp(0, K)
    counts = (counts // run * run).to(torch.int32)
    starts = torch.randint(0, host_rows - run + 1, (bs, -(-K // run)), generator=g)
    src = (starts[:, :, None] + torch.arange(run)).reshape(bs, -1)[:, :K].contiguous()
    dst = torch.argsort(torch.rand((bs, B), generator=g), dim=1)[:, :K].contiguous()
    dst += torch.arange(bs, dtype=torch.int64)[:, None] * B
    return src.to(device), dst.to(device), counts.to(device)


class _Tier:
    """One pinned host tier, viewed as rows of each width; a poisoned hot buffer per case."""

    def __init__(self, nbytes: int) -> None:
        self.flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.flat[: 64 << 20].random_(0, 255)  # the rows the checks read come from here too

    def rows(self, d: int) -> torch.Tensor:
        n = self.flat.numel() // d
        return self.flat[: n * d].view(n, d)


def _copy_fn(host: torch.Tensor, hot: torch.Tensor, lists, **kw):
    from kernels.swap.miss_copy import default_programs, miss_copy

    per_sm = kw.pop("programs_per_sm", None)
    if per_sm is not None:
        from kernels.swap.miss_copy import PROGRAMS_PER_SM

        kw["programs"] = default_programs(hot.device) * per_sm // PROGRAMS_PER_SM
    uva = UVATensor(host)
    return lambda: miss_copy(uva, hot, *lists, **kw)  # noqa: E731


def _bytes_ok(host: torch.Tensor, hot: torch.Tensor, lists) -> bool:
    src, dst, counts = (t.cpu() for t in lists)
    live = torch.arange(K)[None, :] < counts[:, None].long()
    s, d = src[live][:2048], dst[live][:2048]
    return bool(torch.equal(hot[d.cuda()].cpu(), host[s])) if s.numel() else True


def _case(
    tier: _Tier,
    bs: int,
    rate: float,
    d: int,
    ceil: dict,
    reps: int,
    src_bytes: int | None = None,
    label: str = "",
    **kw,
) -> Row:
    """src_bytes: draw the sources from the tier's first src_bytes only."""
    g = torch.Generator().manual_seed(bs * 1000 + int(rate * 100) + d)
    host = tier.rows(d)
    hot = torch.full((bs * B, d), POISON, dtype=torch.uint8, device="cuda")
    lists = miss_lists(bs, rate, (src_bytes or tier.flat.numel()) // d, g)
    us = graph_time_us(_copy_fn(host, hot, lists, **kw), reps)
    n = int(lists[2].sum())
    case = f"bs{bs} {rate:.0%} {d}B{' ' + label if label else ''}"
    if n == 0:
        return Row("miss_copy_situ", case, us, float("nan"), "no misses: launch + count scan")
    nbytes = n * d
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    same = graph_time_us(lambda: flat_dev.copy_(host.view(-1)[:nbytes], non_blocking=True), reps)
    gbs, same_gbs = nbytes / us / 1e3, nbytes / same / 1e3
    return Row(
        "miss_copy_situ",
        case,
        us,
        gbs / ceil["h2d_gbs"],
        f"{n} rows {gbs:.1f} GB/s; pinned 1GiB {ceil['h2d_gbs']:.1f}, same-size copy "
        f"{same_gbs:.1f} GB/s ({gbs / same_gbs:.2f}); target >=0.85; "
        f"bytes ok={_bytes_ok(host, hot, lists)}",
    )


def miss_copy_insitu_case(ceil: dict, reps: int) -> list[Row]:
    """Every (batch, miss rate, row width) on a 4 GiB host tier; then at bs 128, 13%, 1152 B:
    sources from the first 256 MiB or 16 MiB of the tier only (is the scatter over a large
    tier, e.g. in address translation, what slows the copy?) and the tuning variants."""
    tier, rows = _Tier(HOST_TIER_BYTES), []
    for d in ROW_BYTES:
        for bs in BATCHES:
            for rate in MISS_RATES:
                rows.append(_case(tier, bs, rate, d, ceil, reps))
    for small in SMALL_TIERS:
        rows.append(_case(tier, 128, 0.13, 1152, ceil, reps, small, f"src in {small >> 20}MiB"))
    for label, kw in VARIANTS:
        rows.append(_case(tier, 128, 0.13, 1152, ceil, reps, label=label, **kw))
    del tier
    return rows


ALL = [miss_copy_insitu_case]

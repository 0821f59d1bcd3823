"""Host-read cases of bench/kernels/cli.py (issue 40's host reads, issue 38's choice at low
locality): the engine's attention with a fraction f of each request's 2,048 entries read from the
pinned host tier through UVA (slot -2 - row) against the same misses copied in first (miss_copy,
then attention over hot rows only). Same inputs, same bits: the host tier is a pinned copy of the
hot rows, and a host entry names the copy of the row it replaces, so every variant's output must
equal the all-hot run's (checked). Reported per (format, bs, f): the host-read attention, the
copy + attention, their ratio (ratio column: host reads / copy + attend; < 1: reading in place is
cheaper), and the PCIe rate each path gets for the missed bytes."""

from __future__ import annotations

import torch

from bench.kernels.attention_cases import inputs
from bench.kernels.kernel_cases import K
from bench.shared.timing import Row, graph_time_us

FRACTIONS = (0.13, 0.5, 1.0)  # the trace's misses at B = 2K, halfway, the indexer's worst case


def host_entries(slots: torch.Tensor, row_base: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """slots [bs, k] with the masked entries naming the host copy of their row: -2 - (base +
    slot), as the swap plan's host fallback writes them; the others unchanged."""
    rows = row_base[:, None] + slots.long()
    return torch.where(mask, -2 - rows, slots.long()).to(torch.int32)


def miss_lists(
    slots: torch.Tensor, row_base: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, dst, count) of miss_copy for the masked entries: each request's rows first in its
    list (src = dst = base + slot: the host copy sits at the hot row's index), then padding."""
    bs, k = slots.shape
    rows = (row_base[:, None] + slots.long()).masked_fill(~mask, -1)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # masked entries first
    src = torch.gather(rows, 1, order).clamp(min=0).contiguous()
    return src, src.clone(), mask.sum(dim=1, dtype=torch.int32)


def _timed(fmt: str, bs: int, f: float, reps: int):
    """(host-read us, copy + attend us, all-hot us, outputs equal) for one cell."""
    from kernels.attention.sparse import TileWorkspace, sparse_mla_decode
    from kernels.formats import ROW_FORMATS
    from kernels.swap.miss_copy import miss_copy
    from kernels.uva import UVATensor

    fmt_ = ROW_FORMATS[fmt]
    q_nope, q_pe, kv, row_base, slots = inputs(bs, fmt)
    host_t = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
    host_t.copy_(kv)
    host = UVATensor(host_t)
    mask = torch.rand(slots.shape, device="cuda") < f
    encoded = host_entries(slots, row_base, mask)
    src, dst, count = miss_lists(slots, row_base, mask)
    raw_host = UVATensor(host_t.view(torch.uint8).view(kv.shape[0], -1))
    raw_kv = kv.view(torch.uint8).view(kv.shape[0], -1)
    ws = TileWorkspace.allocate(bs, q_nope.shape[1], K, row_format=fmt_, device="cuda")
    outs = [torch.empty((bs, q_nope.shape[1], 512), device="cuda", dtype=torch.bfloat16)]
    outs += [torch.empty_like(outs[0]) for _ in range(2)]
    lse = torch.empty((bs, q_nope.shape[1]), device="cuda", dtype=torch.float32)

    def attend(out, s, **kw):
        sparse_mla_decode(q_nope, q_pe, kv, row_base, s, 576**-0.5, out, lse,
                          row_format=fmt_, workspace=ws, **kw)  # fmt: skip

    def copied() -> None:
        miss_copy(raw_host, raw_kv, src, dst, count)
        attend(outs[2], slots)

    hot_us = graph_time_us(lambda: attend(outs[0], slots), reps)
    read_us = graph_time_us(lambda: attend(outs[1], encoded, host=host), reps)
    copy_us = graph_time_us(copied, reps)
    same = torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    return read_us, copy_us, hot_us, same, int(count.sum()) * fmt_.row_bytes


def host_read_case(ceil: dict, reps: int) -> list[Row]:
    rows = []
    for fmt in ("bf16", "fp8"):
        for bs in (64, 128):
            for f in FRACTIONS:
                read_us, copy_us, hot_us, same, nbytes = _timed(fmt, bs, f, reps)
                rate = lambda us: nbytes / max(us - hot_us, 1e-3) / 1e3  # noqa: E731
                rows.append(
                    Row(
                        "host_read",
                        f"{fmt} bs{bs} k{K} host {f:.0%}",
                        read_us,
                        read_us / copy_us,
                        f"host reads {read_us:.0f}us vs copy+attend {copy_us:.0f}us (all hot "
                        f"{hot_us:.0f}us); missed bytes over the all-hot time: host reads "
                        f"{rate(read_us):.1f} GB/s, copy {rate(copy_us):.1f} GB/s (pinned "
                        f"{ceil['h2d_gbs']:.1f}); bits equal={same}",
                    )
                )
    return rows


ALL = [host_read_case]

"""The cases of bench/kernels.py shared shapes, the bulk miss copy, and the sweep helper the
other case modules use (swap_cases, attention_cases, select_cases, miss_copy_cases,
overlap_cases). Each case returns table rows with a same-run ratio.

Shapes follow the issue's targets: bs 64, k 2048, B 4096, 32K context, H 128.
"""

from __future__ import annotations

import torch

from bench.timing import Row, cpu_call_us, graph_time_us
from kernels.uva import UVATensor

BS, K, B, W, C, P, H = 64, 2048, 4096, 128, 32768, 64, 128


def _distinct(n_rows: int, count: int, lo: int, hi: int) -> torch.Tensor:
    """[n_rows, count] distinct random integers in [lo, hi) per row."""
    return torch.argsort(torch.rand(n_rows, hi - lo), dim=1)[:, :count].to(torch.int32) + lo


def miss_copy_case(ceil: dict, reps: int) -> list[Row]:
    from kernels.swap.miss_copy import miss_copy

    rows = []
    for d in (1152, 656):
        n_miss, per_req = 65536, 1024
        host = torch.empty((4 * n_miss, d), dtype=torch.uint8, pin_memory=True)
        host.random_(0, 255)
        hot = torch.zeros((2 * n_miss, d), dtype=torch.uint8, device="cuda")
        src = torch.randperm(4 * n_miss)[:n_miss].view(BS, per_req).to(torch.int64).cuda()
        dst = torch.randperm(2 * n_miss)[:n_miss].view(BS, per_req).to(torch.int64).cuda()
        count = torch.full((BS,), per_req, dtype=torch.int32, device="cuda")
        uva = UVATensor(host)
        args = (uva, hot, src, dst, count)

        def fn(chunk_bytes: int | None = None, num_warps: int | None = None) -> None:
            extra = {"chunk_bytes": chunk_bytes, "num_warps": num_warps}
            miss_copy(*args, **{k: v for k, v in extra.items() if v is not None})

        us = graph_time_us(fn, reps)
        for chunk, nw in ((16384, 4), (16384, 8), (32768, 8)):
            v_us = graph_time_us(lambda chunk=chunk, nw=nw: fn(chunk, nw), reps)
            v_gbs = n_miss * d / v_us / 1e3
            rows.append(
                Row(
                    "miss_copy",
                    f"{d} B chunk={chunk} warps={nw}",
                    v_us,
                    v_gbs / ceil["h2d_gbs"],
                    f"{v_gbs:.1f} GB/s (variant)",
                )
            )
        ok = torch.equal(hot[dst.view(-1)[:512]].cpu(), host[src.view(-1)[:512].cpu()])
        gbs = n_miss * d / us / 1e3
        rows.append(
            Row(
                "miss_copy",
                f"{n_miss} rows x {d} B",
                us,
                gbs / ceil["h2d_gbs"],
                f"{gbs:.1f} GB/s vs pinned copy {ceil['h2d_gbs']:.1f}; target >=0.90; "
                f"bytes ok={ok}; cpu/call {cpu_call_us(fn):.1f}us",
            )
        )
    return rows


def sweep(name: str, case: str, variants: dict, reps: int, judge) -> list[Row]:
    """Times every variant (label -> fn) in this run, then a BEST row. judge(label, us) gives
    (ratio, note). A variant that fails (say, over the shared-memory limit) gets an ERROR row."""
    rows, timed = [], []
    for label, fn in variants.items():
        try:
            us = graph_time_us(fn, reps, inner=5)
        except Exception as exc:  # one bad config must not hide the others
            rows.append(
                Row(
                    name,
                    f"{case} [{label}]",
                    float("nan"),
                    float("nan"),
                    "ERROR " + repr(exc)[:100],
                )
            )
            continue
        ratio, note = judge(label, us)
        rows.append(Row(name, f"{case} [{label}]", us, ratio, note))
        timed.append((us, label, ratio, note))
    if timed:
        us, label, ratio, note = min(timed)
        rows.append(Row(name, f"{case} BEST [{label}]", us, ratio, note))
    return rows


ALL = [miss_copy_case]

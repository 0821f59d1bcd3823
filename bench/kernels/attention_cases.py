"""Attention cases of bench/kernels/cli.py: the two-pass decode the engine runs (its measured launch
table, kernels/attention/configs.py) against the fused kernel's settings, per row format, in
TFLOPS-equivalent (2 * 128 * 2048 * 1088 = 570 MFLOP per request-layer) and as a multiple of
the same run's floors: HBM (the rows read once) and bf16 matmul (the FLOPs at the measured
rate). bench/kernels/attention_sweep.py is the full launch sweep behind the table."""

from __future__ import annotations

import torch

from bench.kernels.kernel_cases import B, H, K, _distinct, sweep
from bench.shared.timing import Row, cpu_call_us

FLOP_PER_ROW = 2 * H * K * (576 + 512)
# The same-run anchor (fp8 rows only): DeepSeek's FlashMLA on the same inputs, where it loads.
FLASHMLA = "FlashMLA sparse decode (anchor)"
# (label, workspace: "tiles", a split count, or None; fused kernel keywords). The first is the
# engine's (the two-pass kernel with the table's launch for the batch).
VARIANTS = [
    ("two-pass (engine)", "tiles", {}),
    ("fused bn64 st2", None, dict(block_n=64, num_stages=2)),
    ("fused split2 bn32 st3 (old engine)", 2, dict(block_n=32, num_stages=3)),
]


def inputs(bs: int, fmt: str):
    """Random q, rows (quantized for fp8), bases and distinct slots for bs requests."""
    from kernels.formats import ROW_FORMATS
    from kernels.store.fp8_row import kv_quantize

    row_format = ROW_FORMATS[fmt]
    kv = torch.randn((bs * B, 576), device="cuda", dtype=torch.bfloat16)
    if row_format.quantize is not None:
        rows = kv
        kv = torch.empty((bs * B, row_format.row_bytes), device="cuda", dtype=torch.uint8)
        kv_quantize(rows, kv, row_format=row_format)
    q_nope = torch.randn((bs, H, 512), device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn((bs, H, 64), device="cuda", dtype=torch.bfloat16)
    row_base = torch.arange(bs, device="cuda", dtype=torch.int64) * B
    return q_nope, q_pe, kv, row_base, _distinct(bs, K, 0, B).cuda()


def attention_sweep(bs: int, ceil: dict, reps: int, fmt: str = "bf16") -> list[Row]:
    from kernels.attention.sparse import AttnWorkspace, TileWorkspace, sparse_mla_decode
    from kernels.formats import ROW_FORMATS

    row_format = ROW_FORMATS[fmt]
    q_nope, q_pe, kv, row_base, slots = inputs(bs, fmt)
    call = (q_nope, q_pe, kv, row_base, slots, 576**-0.5)
    outs = {
        label: torch.empty((bs, H, 512), device="cuda", dtype=torch.bfloat16)
        for label, _, _ in VARIANTS
    }
    lse = torch.empty((bs, H), device="cuda", dtype=torch.float32)
    fns = {}
    anchor = _flashmla(fmt, call, outs)
    for label, ws, kw in VARIANTS:
        if ws == "tiles":
            w = TileWorkspace.allocate(bs, H, K, row_format=row_format, device="cuda")
        else:
            w = None if ws is None else AttnWorkspace.allocate(bs, H, ws, device="cuda")
        fns[label] = lambda o=outs[label], w=w, kw=kw: sparse_mla_decode(  # noqa: E731
            *call, o, lse, row_format=row_format, workspace=w, **kw
        )
    fns.update(anchor)
    hbm = bs * K * kv.shape[1] * kv.element_size() / (ceil["d2d_gbs"] * 1e3)
    mm = bs * FLOP_PER_ROW / (ceil["mm_tflops"] * 1e6)
    first = outs[VARIANTS[0][0]]

    def judge(label: str, us: float):
        diff = (outs[label].float() - first.float()).abs().max().item()
        rl = us / bs
        return us / hbm, (
            f"{rl:.2f}us/req-layer = {FLOP_PER_ROW / (rl * 1e6):.0f} TFLOPS-eq; x HBM floor "
            f"{hbm:.1f}us (ratio col), x matmul floor {us / mm:.2f}; max|out - engine| "
            f"{diff:.1e}; cpu/call {cpu_call_us(fns[label]):.1f}us"
        )

    return sweep("sparse_attn", f"bs{bs} H128 k2048 {fmt}", fns, reps, judge)


def _flashmla(fmt: str, call: tuple, outs: dict) -> dict:
    """FlashMLA's sparse decode on the same fp8 rows (bench/kernels/flashmla_anchor.py), as one
    more variant; its output lands in outs[FLASHMLA] as [bs, H, 512] (a view of the graph's own
    tensor: no copy is timed). Nothing where it cannot run (printed once per case)."""
    from bench.kernels import flashmla_anchor

    if fmt != "fp8":
        return {}
    why = flashmla_anchor.available()
    if why is not None:
        print(f"sparse_attn: no {FLASHMLA} anchor: {why}")
        return {}
    decode = flashmla_anchor.decode_call(*call)
    try:
        decode()  # the scheduling metadata, made outside any capture
    except Exception as exc:  # a wheel that loads but refuses these arguments: say so, go on
        print(f"sparse_attn: no {FLASHMLA} anchor: its first call failed: {exc!r}"[:300])
        return {}

    def run() -> None:
        outs[FLASHMLA] = decode()[0].squeeze(1)

    return {FLASHMLA: run}


def attention_case(ceil: dict, reps: int) -> list[Row]:
    """Both row formats at bs 8 (split-k territory), 64 and 128; then fp8 over bf16, each at
    the engine's kernel (target: fp8 faster)."""
    rows, engine = [], {}
    for bs in (8, 64, 128):
        for fmt in ("bf16", "fp8"):
            swept = attention_sweep(bs, ceil, reps, fmt)
            rows += swept
            engine[bs, fmt] = next(
                (r.us for r in swept if r.case.endswith(f"[{VARIANTS[0][0]}]")), float("nan")
            )
        f8, b16 = engine[bs, "fp8"], engine[bs, "bf16"]
        rows.append(
            Row(
                "sparse_attn",
                f"bs{bs} fp8/bf16 (engine)",
                f8,
                f8 / b16,
                f"per request-layer: fp8 {f8 / bs:.2f}us, bf16 {b16 / bs:.2f}us; targets at "
                "bs>=64: fp8 <=1.6us, bf16 <=2.0us, ratio <1",
            )
        )
    return rows


ALL = [attention_case]

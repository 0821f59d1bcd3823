"""FlashMLA's sparse fp8 decode as a same-run anchor for our attention (issue 38 item 4).

DeepSeek's FlashMLA reads the same 656-byte V3.2 rows our fp8 attention reads
(kernels/store/fp8_row.py names the format after it), so both kernels can run on one set of
rows, queries and top-k slots. The kernels come from SGLang's packaging of FlashMLA
(`sgl-flash-mla`, its "legacy" op namespace holds the SM90 kernels and the V3.2 format;
`bash bench/device_wheels.sh flashmla` fetches the wheel). Absent the wheel, or where it does not
load (it is built for torch >= 2.14 through the stable ABI; the device has 2.11), `available()`
says why and the attention case leaves the anchor out.

Only the mapping of our arguments onto FlashMLA's is here: q as one [576] vector per head
(latent then rope, as our kernel concatenates them), the rows as pages of PAGE rows, and each
slot's absolute row (row_base + slot) as the index, -1 where the slot is padding (FlashMLA
treats exactly -1 as invalid and checks nothing else).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rows per FlashMLA page: any divisor of the row count works (indices are absolute rows); 64 is
# the page size FlashMLA's own tests and SGLang use.
PAGE = 64


def available() -> str | None:
    """None if FlashMLA's SM90 sparse decode can run here, else why not."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import flash_mla
    except Exception as exc:  # ImportError, or an OSError from a library that will not load
        return f"flash_mla does not import: {exc!r}"[:200]
    if not flash_mla.has_legacy():
        return "this flash_mla build has no SM90 (legacy) kernels"
    return None


def inputs(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    row_base: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our attention's arguments as FlashMLA's: q [bs, 1, H, 576] bf16, the rows as pages
    [n / PAGE, PAGE, 1, row bytes] (a view), indices [bs, 1, k] int32."""
    n, width = kv.shape
    if kv.dtype != torch.uint8 or n % PAGE:
        raise ValueError(
            f"kv: expected uint8 fp8 rows, a multiple of {PAGE}, got {tuple(kv.shape)}"
        )
    if slots.dim() != 2 or row_base.shape != (slots.shape[0],):
        raise ValueError(f"slots {tuple(slots.shape)} and row_base {tuple(row_base.shape)} differ")
    q = torch.cat([q_nope, q_pe], dim=-1).unsqueeze(1)
    pages = kv.view(n // PAGE, PAGE, 1, width)
    rows = slots.to(torch.int64) + row_base[:, None]
    indices = torch.where(slots >= 0, rows, -1).to(torch.int32).unsqueeze(1)
    return q, pages, indices


def decode_call(
    q_nope, q_pe, kv, row_base, slots, scale: float
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A call of FlashMLA's sparse decode on our arguments: (out [bs, 1, H, 512], lse). Its
    scheduling metadata is made on the first call (make that one outside a graph capture)."""
    import flash_mla

    q, pages, indices = inputs(q_nope, q_pe, kv, row_base, slots)
    meta, _ = flash_mla.get_mla_metadata()

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return flash_mla.flash_mla_with_kvcache(
            q,
            pages,
            None,
            None,
            q_nope.shape[-1],
            meta,
            softmax_scale=scale,
            is_fp8_kvcache=True,
            indices=indices,
            use_legacy=True,
        )

    return call

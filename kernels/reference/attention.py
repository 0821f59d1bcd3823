"""Reference of the sparse MLA decode attention (kernels/attention/sparse.py)."""

from __future__ import annotations

import torch

from kernels.formats import BF16_ROW, RowFormat


def _gathered_rows(kv, row_base, slots, host) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [bs, k, width] as stored, valid [bs, k]): kv's row row_base + slot for slot >= 0;
    with a host tier, its row -2 - slot for slot <= -2 and -1 the only skipped entry."""
    hot = slots >= 0
    picked = kv[torch.where(hot, row_base[:, None] + slots.long(), 0)]
    if host is None:
        return picked, hot
    host = getattr(host, "tensor", host)  # a kernels.uva.UVATensor: its pinned tensor
    cold = slots <= -2
    from_host = host[torch.where(cold, -2 - slots.long(), 0).to(host.device)].to(kv.device)
    return torch.where(cold[..., None], from_host, picked), slots != -1


def ref_sparse_mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    row_base: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    row_format: RowFormat = BF16_ROW,
    workspace=None,
    host=None,
) -> None:
    """Absorbed MLA decode over the rows `row_base[b] + slots[b, i]` (slot < 0 skipped), fp64 math.
    kv: rows as `row_format` has attention read them (bf16 values, or stored bytes that its
    dequantize decodes first). `workspace` (the kernel's split-k scratch) is accepted and unused.
    host: the host tier's rows, as kv's; then slot <= -2 reads host[-2 - slot], -1 is skipped."""
    d_v = q_nope.shape[-1]
    picked, valid = _gathered_rows(kv, row_base, slots, host)
    decode = row_format.dequantize
    picked = picked if decode is None else decode(picked)
    k = torch.where(valid[..., None], picked.double(), 0.0)  # [bs, k, 576]
    q = torch.cat([q_nope, q_pe], dim=-1).double()  # [bs, H, 576]
    s = scale * torch.einsum("bhd,bkd->bhk", q, k)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse_d = torch.logsumexp(s, dim=-1)  # -inf for rows with no valid slot
    p = torch.exp(s - torch.where(torch.isinf(lse_d), 0.0, lse_d)[..., None])
    out.copy_(torch.einsum("bhk,bkd->bhd", p, k[..., :d_v]))
    lse.copy_(lse_d)

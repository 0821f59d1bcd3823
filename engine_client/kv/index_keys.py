"""Encoding of lightning-indexer keys into index-pool rows (`KVLayout.index_format`).

bf16: the 128 bf16 values (256 B). fp8: 128 float8_e4m3fn values then one fp32 scale (132 B),
with value = fp8 * scale and scale = amax / 448 per key, like DeepSeek-V3.2's per-token fp8
indexer cache. Both encoders are plain tensor ops without host sync (usable in a CUDA graph).
These are append rows; in the index pool fp8 pages are page-blocked (a page's P x 128 values,
then its P scales: kernels.reference.fp8_page_views), which kv_append and the baseline backend's
store take care of.
"""

from __future__ import annotations

import torch

from contract.layout import INDEX_FORMATS

FP8_MAX = 448.0
# Keys that are all zero still get a finite, positive scale.
_MIN_SCALE = 1e-12


def encode_index_keys(keys: torch.Tensor, index_format: str) -> torch.Tensor:
    """keys [n, 128] (any float dtype) -> index rows [n, I] uint8."""
    if index_format not in INDEX_FORMATS:
        raise ValueError(f"unknown index format {index_format!r}")
    if keys.dim() != 2 or keys.shape[1] != 128:
        raise ValueError(f"index keys must be [n, 128], got {tuple(keys.shape)}")
    if index_format == "bf16":
        return keys.to(torch.bfloat16).contiguous().view(torch.uint8)
    k = keys.float()
    scale = (k.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (k / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat((q.view(torch.uint8), scale.view(torch.uint8)), dim=1)


def decode_index_keys(rows: torch.Tensor, index_format: str) -> torch.Tensor:
    """index rows [n, I] uint8 -> keys [n, 128] fp32 (for tests and references)."""
    if rows.shape[-1] != INDEX_FORMATS.get(index_format, -1):
        raise ValueError(f"rows of {rows.shape[-1]} B are not {index_format!r} index keys")
    if index_format == "bf16":
        return rows.contiguous().view(torch.bfloat16).float()
    q = rows[:, :128].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[:, 128:].contiguous().view(torch.float32)
    return q * scale

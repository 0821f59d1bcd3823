"""The index-key pool's page layout (written by kernels/store/append.py, read by
kernels/select/indexer.py): a page of P keys holds their value bytes, then their scale bytes
(kernels.formats)."""

from __future__ import annotations

import torch

from kernels.formats import IndexFormat


def page_views(pool: torch.Tensor, fmt: IndexFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (values [..., N, P, value_bytes], scales [..., N, P, scale_bytes]) of an index pool
    [..., N, P, key_bytes] whose last two dims are contiguous: a page holds its P keys' values,
    then their P scales (kernels.formats). Writing into them writes the pool."""
    P, V = pool.shape[-2], fmt.value_bytes
    flat = pool.view(*pool.shape[:-2], P * fmt.key_bytes)
    return (
        flat[..., : P * V].unflatten(-1, (P, V)),
        flat[..., P * V :].unflatten(-1, (P, fmt.scale_bytes)),
    )


def read_index_rows(
    pool: torch.Tensor, pages: torch.Tensor, offs: torch.Tensor, fmt: IndexFormat
) -> torch.Tensor:
    """Append-format rows [n, I] of tokens (pages[i], offs[i]) of an index pool [N, P, I]."""
    values, scales = page_views(pool, fmt)
    return torch.cat((values[pages, offs], scales[pages, offs]), dim=-1)


def write_index_rows(
    pool: torch.Tensor,
    pages: torch.Tensor,
    offs: torch.Tensor,
    rows: torch.Tensor,
    fmt: IndexFormat,
) -> None:
    """Store append-format rows [n, I] at tokens (pages[i], offs[i]) of an index pool [N, P, I]
    (plain tensor indexing: no host sync, graph-capturable on CUDA)."""
    values, scales = page_views(pool, fmt)
    values[pages, offs] = rows[..., : fmt.value_bytes]
    scales[pages, offs] = rows[..., fmt.value_bytes :]

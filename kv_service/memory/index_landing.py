"""Where a prefill engine's NIXL writes put a prompt's index keys on a GPU service: a pinned host
mirror of the index-key pool, moved into the pool by the service's own copy when the request
lands (`Prefilled`: `books/ledger.py:PageLedger.land` takes the request's private pages; the
shared pages of its cached prefix are not written, their keys are in the pool).

Why not straight into the pool: the pool is device memory, and on the machines measured a NIXL
write into device memory runs at ~0.5 GB/s, whatever its source (UCX stages it; runs AA and AC:
pinned host -> VRAM 0.49-0.57 GB/s, pinned host -> pinned host 3.6-6 GB/s). With the keys in host
memory every byte of a staged prefill write goes host to host, and the pages' keys reach the
pool by one host-to-device copy per run of consecutive pages (tens of GB/s).

Cost: pinned host memory the size of the index-key pool (about a fifth of the host tier's rows
for V3.2's formats), only with `--nixl` on a GPU. On CPU the pool is host memory already: no
mirror, the writes land in the pool itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class IndexLanding:
    """A pinned mirror of `pool` ([L, pages, P, I]) that remote writers fill; `take` copies a
    request's landed pages into the pool on the current stream (its caller synchronizes before
    replying, as every landing does)."""

    def __init__(self, pool: torch.Tensor, mirror: torch.Tensor | None = None) -> None:
        """mirror: the buffer writers fill [a new pinned one, shaped and strided as pool]."""
        if mirror is None:
            mirror = torch.empty_strided(
                pool.shape, pool.stride(), dtype=pool.dtype, pin_memory=pool.is_cuda
            )
        if mirror.shape != pool.shape or mirror.stride() != pool.stride():
            raise ValueError(
                f"index landing: mirror {tuple(mirror.shape)} strides {mirror.stride()} is "
                f"not laid out as the pool {tuple(pool.shape)} strides {pool.stride()}"
            )
        self.pool, self.mirror = pool, mirror

    def take(self, pages: Sequence[int]) -> int:
        """Copy pages `pages` (the pool's page ids, any order) of every layer from the mirror into
        the pool; returns the number of copies made (one per run of consecutive ids)."""
        n_pages = self.pool.shape[1]
        if any(not 0 <= p < n_pages for p in pages):
            raise ValueError(f"index landing: a page outside [0, {n_pages}): {list(pages)}")
        runs = _runs(sorted(set(pages)))
        for first, count in runs:
            self.pool[:, first : first + count].copy_(
                self.mirror[:, first : first + count], non_blocking=True
            )
        return len(runs)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids as (first, count) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs

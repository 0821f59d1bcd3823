"""A decode layer's tail in row parts (`--decode-part-tail`, issue 38): each part's rows run
W_UV, o_proj, the residual, the post-attention norm, the MLP and its residual as soon as that
part's attention is launched, instead of the whole batch after every part's attention.

Why: with decode micro-batches (HiSparseBackend.microbatches) the last part's miss copy has only
the previous part's attention beside it on the main stream, and its own attention waits for it
(~1.26 ms of "exposure" in the 14 ms fp8 step, docs/BENCHMARKS.md run Q). With the part tail the
first part's GEMMs run on the main stream while the last part's copy is still in flight.

Who splits: the model (`Model.tail_parts`, one value from the engine's settings), never the
backend. cuBLAS picks its kernel and split-K by M, so the split decides a row's bits: the four KV
modes split their GEMMs identically (the baseline and remote-swap backends attend in one part)
and stay bitwise equal to each other. The tail's parts are `row_parts` of the batch with the
model's count; a tail part runs once the attention has covered all of its rows, whatever parts
the backend attends in, so the GEMMs (and bits) do not depend on the backend.

Where: every decode forward (plain steps, speculative verify steps, whose parts hold whole
requests, and the MTP layer's draft passes). Prefill chunks keep the whole-chunk tail: they have
no side-stream copy to hide. Parts are Python ints of the batch's shape: graph-capturable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class PartTails:
    """Runs tail(rows, out[rows]) for each part in order once rows [0, part.stop) are attended;
    `out` [n, hidden] is the layer's output (every part writes its own rows)."""

    def __init__(
        self, x: torch.Tensor, parts: list[slice], tail: Callable[[slice, torch.Tensor], object]
    ) -> None:
        self.out = torch.empty_like(x)
        self._pending, self._tail = list(parts), tail

    def __call__(self, attended: int) -> None:
        """Rows [0, attended) are attended: run every waiting part within them."""
        while self._pending and self._pending[0].stop <= attended:
            r = self._pending.pop(0)
            self._tail(r, self.out[r])

    def finish(self) -> torch.Tensor:
        """The layer's output, once every part ran (the attention covered every row)."""
        if self._pending:
            raise RuntimeError(f"attention never covered the tail parts {self._pending}")
        return self.out

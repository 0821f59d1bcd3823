"""The scratch of one forward: the buffers the model fills per layer, and the kernels' own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine_client.model.preset import ModelConfig
from kernels.attention.sparse import AttnWorkspace, TileWorkspace
from kernels.formats import BF16_ROW, RowFormat
from kernels.select.topk import TopkWorkspace


@dataclass(frozen=True)
class Workspace:
    """Per-forward scratch: scores [n, S] fp32, topk [n, k] int32, attention out [n, H, 512]
    bf16 and lse [n, H] fp32, plus the kernels' own scratch (segmented top-k; the attention's
    tile probabilities or split partials). Decode keeps one at fixed addresses; prefill makes
    one per chunk."""

    scores: torch.Tensor
    topk: torch.Tensor
    attn_out: torch.Tensor
    lse: torch.Tensor
    topk_scratch: TopkWorkspace | None = None
    attn_scratch: AttnWorkspace | TileWorkspace | None = None

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        n: int,
        width: int,
        device: torch.device,
        *,
        attn_splits: int | None = None,
        row_format: RowFormat = BF16_ROW,
    ) -> "Workspace":
        """attn_splits None: the two-pass decode attention, whose scratch (and bits) depend on
        top-k and row format alone, so a row's bits never depend on the batch it is in;
        1: the fused kernel in one pass, no scratch (prefill chunks); > 1: fused split-k.
        row_format: the KV layout's (the model's config has none: the layout owns it); one
        without a Triton variant runs on the reference kernels, which take no scratch."""
        attn: AttnWorkspace | TileWorkspace | None = None
        if attn_splits is None and row_format.kernel is not None:
            attn = TileWorkspace.allocate(
                n, cfg.num_heads, cfg.topk, row_format=row_format, device=device
            )
        elif attn_splits is not None and attn_splits > 1:
            attn = AttnWorkspace.allocate(
                n, cfg.num_heads, attn_splits, d_v=cfg.kv_lora_rank, device=device
            )
        return cls(
            scores=torch.empty((n, width), dtype=torch.float32, device=device),
            topk=torch.empty((n, cfg.topk), dtype=torch.int32, device=device),
            attn_out=torch.empty(
                (n, cfg.num_heads, cfg.kv_lora_rank), dtype=cfg.torch_dtype, device=device
            ),
            lse=torch.empty((n, cfg.num_heads), dtype=torch.float32, device=device),
            topk_scratch=TopkWorkspace.allocate(n, width, device=device),
            attn_scratch=attn,
        )

    def rows(self, n: int) -> "Workspace":
        # The kernels' scratch serves any batch up to its capacity: kept whole.
        return dataclasses.replace(
            self,
            scores=self.scores[:n],
            topk=self.topk[:n],
            attn_out=self.attn_out[:n],
            lse=self.lse[:n],
        )

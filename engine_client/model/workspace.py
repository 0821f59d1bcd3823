"""The scratch of one forward: the buffers the model fills per layer, and the kernels' own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine_client.model.preset import ModelConfig
from kernels.sparse_attention import AttnWorkspace, decode_num_splits
from kernels.topk import TopkWorkspace


@dataclass(frozen=True)
class Workspace:
    """Per-forward scratch: scores [n, S] fp32, topk [n, k] int32, attention out [n, H, 512]
    bf16 and lse [n, H] fp32, plus the kernels' own scratch (segmented top-k; split-k attention
    when attn_scratch is set). Decode keeps one at fixed addresses; prefill makes one per chunk."""

    scores: torch.Tensor
    topk: torch.Tensor
    attn_out: torch.Tensor
    lse: torch.Tensor
    topk_scratch: TopkWorkspace | None = None
    attn_scratch: AttnWorkspace | None = None

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        n: int,
        width: int,
        device: torch.device,
        *,
        attn_splits: int | None = None,
    ) -> "Workspace":
        """attn_splits: attention's split count; by default a function of cfg.topk alone, so a
        row's bits never depend on the batch it is in. 1 = single pass, no scratch."""
        splits = decode_num_splits(cfg.topk) if attn_splits is None else attn_splits
        attn = (
            AttnWorkspace.allocate(n, cfg.num_heads, splits, d_v=cfg.kv_lora_rank, device=device)
            if splits > 1
            else None
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

"""Model shapes of the decode engine: one frozen `ModelConfig` and the named presets.

The attention shapes follow DeepSeek-V3.2 (MLA + lightning indexer). Three of them are fixed by
the KV formats the service shares with us (kernels.formats): a KV row is kv_lora (512) + rope
(64) values and an indexer key 128 values. How rows and keys are stored (the row and index
formats) is the KV layout's business, not the model's: the model hands its backend bf16 rows.

Torch-free at import: the command line reads the presets before torch is needed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_client.text.names import DEEPSEEK_TOKENIZER, TINY_TOKENIZER
from kernels.formats import INDEX_DIM, LATENT_DIM, ROPE_DIM

if TYPE_CHECKING:
    import torch

KV_LORA_RANK = LATENT_DIM

# Model dtypes by name: the torch dtype of each.
_DTYPES = {"bf16": "bfloat16"}


class ConfigError(ValueError):
    """A model configuration that cannot run on the shared KV layout."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a DeepSeek-V3.2-style decode model.

    vocab_size, hidden_size, num_layers   the usual
    num_heads       H attention heads (V3.2: 128)
    q_lora_rank     query low-rank dim (V3.2: 1536)
    kv_lora_rank    latent KV dim, 512 (fixed by the row layout)
    rope_dim        rotary part of q/k, 64 (fixed by the row layout)
    qk_nope_dim     non-rotary part of each query/key head (128)
    v_head_dim      value head dim (128)
    index_heads     lightning-indexer heads (V3.2: 64)
    index_dim       indexer head dim, 128 (fixed by the index-key layout)
    topk            tokens attention reads per (layer, request) (V3.2: 2048)
    mlp_hidden      dense SwiGLU hidden size; 0 = no MLP
    mtp_layers      multi-token-prediction layers after the decoder layers (V3.2: 1, checkpoint
                    layer num_layers); 1 gives speculative decoding its draft module
    rope_theta      RoPE base; plain RoPE (V3.2's YaRN long-context scaling is not modelled)
    norm_eps        RMSNorm / LayerNorm epsilon
    dtype           weight and activation dtype; only "bf16"
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = KV_LORA_RANK
    rope_dim: int = ROPE_DIM
    qk_nope_dim: int = 128
    v_head_dim: int = 128
    index_heads: int = 64
    index_dim: int = INDEX_DIM
    topk: int = 2048
    mlp_hidden: int = 0
    mtp_layers: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "q_lora_rank",
            "qk_nope_dim",
            "v_head_dim",
            "index_heads",
            "topk",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        fixed = {"kv_lora_rank": KV_LORA_RANK, "rope_dim": ROPE_DIM, "index_dim": INDEX_DIM}
        for name, want in fixed.items():
            if getattr(self, name) != want:
                raise ConfigError(
                    f"{name} is fixed at {want} by the KV layout, got {getattr(self, name)}"
                )
        if self.mtp_layers not in (0, 1):
            raise ConfigError(f"mtp_layers must be 0 or 1, got {self.mtp_layers}")
        if self.mlp_hidden < 0:
            raise ConfigError(f"mlp_hidden must be >= 0 (0 = no MLP), got {self.mlp_hidden}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ConfigError("rope_theta and norm_eps must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, _DTYPES[self.dtype])
        return dtype

    @property
    def kv_layers(self) -> int:
        """Layers whose KV the backend holds: the decoder layers, then the MTP layer's."""
        return self.num_layers + self.mtp_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.rope_dim

    @property
    def row_dim(self) -> int:
        """Values per KV row: latent + rope."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def index_weight_scale(self) -> float:
        """Scale on weights_proj(x): 1/sqrt(index_heads * index_dim), as V3.2 folds its
        n_heads^-0.5 head mixing and index_dim^-0.5 softmax scale into the head weights."""
        return (self.index_heads * self.index_dim) ** -0.5

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# CPU tests: real 576-value rows and 128-dim index keys, everything else tiny (16 indexer heads:
# the fewest kernels.select.indexer takes).
TINY = ModelConfig(
    vocab_size=1024,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    q_lora_rank=32,
    qk_nope_dim=32,
    v_head_dim=32,
    index_heads=16,
    topk=16,
    mlp_hidden=128,
)

# Benchmark shapes: V3.2 attention (H 128, q_lora 1536, hidden 7168) on 4 layers. Per layer the
# weights read each step are attention 201M params (q_a 11.0M, q_b 37.7M, kv_a 4.1M, kv_b 16.8M,
# o 117.4M, indexer 14.0M) + dense MLP 3 x 7168 x 23552 = 506.5M params: 1.42 GB in bf16. That
# is what one GPU of an 8-way expert-parallel V3.2 decode reads per layer at large batch
# (32 local experts x 44M fp8 params = 1.41 GB, plus fp8 attention and the shared expert).
# The output layer (7168 x 129,280: 1.85 GB in bf16) is read once per step.
BENCH = ModelConfig(vocab_size=129280, hidden_size=7168, num_layers=4, mlp_hidden=23552)

# Full DeepSeek-V3.2 attention shapes on 61 layers, without MLP (attention weights alone are
# 0.40 GB per layer, 24.5 GB for 61 layers; MoE weights would not fit beside a KV budget).
# V3.2 is served with fp8 KV rows: a layout choice (--row-format fp8), not the model's.
V32 = ModelConfig(vocab_size=129280, hidden_size=7168, num_layers=61)

PRESETS = {"tiny": TINY, "bench": BENCH, "v32": V32}
# Each preset's tokenizer (engine_client.text.vocabulary names). The vocabulary sizes above are
# those tokenizers' (DeepSeek-V3.2's 129,280; the tiny cut's 1,024:
# tests/engine_client/model/test_weights.py checks both); the engine replaces vocab_size with its
# tokenizer's when --tokenizer names another.
TOKENIZERS = {"tiny": TINY_TOKENIZER, "bench": DEEPSEEK_TOKENIZER, "v32": DEEPSEEK_TOKENIZER}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset, optionally with some fields replaced (e.g. num_layers=2)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]

"""Model weights: seeded random init, and safetensors load/save under DeepSeek-V3.2 tensor names.

Weights are kept by their checkpoint name in one flat dict, so the loader, the saver and the
random init share a single table of names and shapes (`weight_shapes`). Checkpoints must hold
float tensors (bf16, fp16 or fp32; cast to the model dtype); DeepSeek's block-fp8 weights with
`weight_scale_inv` must be dequantized first. Tensors the model does not use (MoE experts, extra
layers, the MTP layer unless `mtp_layers`) are ignored. V3.2's MTP layer is checkpoint layer
`num_layers`: a decoder layer plus enorm, hnorm, eh_proj and shared_head.norm (its embedding and
output head are the model's own, shared).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine_client.model.preset import ModelConfig

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Blocks of each checkpoint file read for its fingerprint (evenly spaced, first and last).
FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK_BYTES = 16, 1 << 16


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: missing, mis-shaped or non-float tensors."""


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, by DeepSeek-V3.2 checkpoint name."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        shapes.update(_layer_shapes(cfg, i))
    if cfg.mtp_layers:
        p = layer_prefix(cfg.num_layers)
        shapes.update(_layer_shapes(cfg, cfg.num_layers))
        shapes.update(
            {
                p + "enorm.weight": (h,),
                p + "hnorm.weight": (h,),
                p + "eh_proj.weight": (h, 2 * h),
                p + "shared_head.norm.weight": (h,),
            }
        )
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """The tensors of decoder layer i (the MTP layer's block has the same)."""
    h, H = cfg.hidden_size, cfg.num_heads
    p = layer_prefix(i)
    a = p + "self_attn."
    shapes = {
        p + "input_layernorm.weight": (h,),
        a + "q_a_proj.weight": (cfg.q_lora_rank, h),
        a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
        a + "q_b_proj.weight": (H * cfg.qk_head_dim, cfg.q_lora_rank),
        a + "kv_a_proj_with_mqa.weight": (cfg.row_dim, h),
        a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        a + "kv_b_proj.weight": (H * (cfg.qk_nope_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        a + "o_proj.weight": (h, H * cfg.v_head_dim),
        a + "indexer.wq_b.weight": (cfg.index_heads * cfg.index_dim, cfg.q_lora_rank),
        a + "indexer.wk.weight": (cfg.index_dim, h),
        a + "indexer.k_norm.weight": (cfg.index_dim,),
        a + "indexer.k_norm.bias": (cfg.index_dim,),
        a + "indexer.weights_proj.weight": (cfg.index_heads, h),
        p + "post_attention_layernorm.weight": (h,),
    }
    if cfg.mlp_hidden:
        shapes.update(
            {
                p + "mlp.gate_proj.weight": (cfg.mlp_hidden, h),
                p + "mlp.up_proj.weight": (cfg.mlp_hidden, h),
                p + "mlp.down_proj.weight": (h, cfg.mlp_hidden),
            }
        )
    return shapes


def _init_std(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> float | None:
    """Std of a random weight (None: a norm parameter, set to its identity value).

    Matrices get 1/sqrt(fan_in) so activations stay near unit scale in bf16; the two matrices
    that write into the residual stream are further scaled by 1/sqrt(2 * layers) so the residual
    does not grow with depth."""
    if len(shape) == 1:
        return None
    if name == "model.embed_tokens.weight":
        return 1.0
    std = shape[1] ** -0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * cfg.num_layers)
    return std


def random_weights(
    cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Deterministic random weights. Each tensor has its own generator seeded from (seed, name),
    so a tensor does not depend on the others (e.g. on the layer count). Generated on `device`
    because CPU generation of multi-GB presets is slow; CPU and CUDA draw different numbers."""
    device = torch.device(device)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        std = _init_std(name, shape, cfg)
        if std is None:
            fill = 0.0 if name.endswith(".bias") else 1.0
            out[name] = torch.full(shape, fill, dtype=cfg.torch_dtype, device=device)
            continue
        gen = torch.Generator(device=device)
        gen.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        w = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
        out[name] = w.mul_(std).to(cfg.torch_dtype)
    return out


def _checkpoint_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def model_fingerprint(cfg: ModelConfig, checkpoint: str | None, seed: int) -> str:
    """Names the model and its weights for the prefix cache: every shape of `cfg`, and the seed
    of random weights or samples of every checkpoint file (name, size, 16 blocks of 64 KiB):
    a fine-tune with the same shapes changes its bytes everywhere, so the samples differ,
    while reading ~1 MiB per file keeps the start fast. Random weights are drawn on the
    service's device, which every engine of one service shares."""
    h = hashlib.blake2b(
        json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode(), digest_size=16
    )
    if checkpoint is None:
        h.update(f"random:{seed}".encode())
    for file in _checkpoint_files(Path(checkpoint)) if checkpoint else ():
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            step = max(size - FINGERPRINT_BLOCK_BYTES, 0) // (FINGERPRINT_BLOCKS - 1)
            for i in range(FINGERPRINT_BLOCKS):
                f.seek(i * step, os.SEEK_SET)
                h.update(f.read(FINGERPRINT_BLOCK_BYTES))
    return "w1:" + h.hexdigest()


def _read_tensor(
    f, name: str, want: tuple[int, ...], cfg: ModelConfig, device: torch.device
) -> torch.Tensor:
    t = f.get_tensor(name)
    if tuple(t.shape) != want:
        raise CheckpointError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise CheckpointError(
            f"{name}: dtype {t.dtype} is not bf16/fp16/fp32 "
            f"(dequantize fp8 checkpoints before loading)"
        )
    return t.to(device=device, dtype=cfg.torch_dtype).contiguous()


def load_safetensors(
    path: str | Path, cfg: ModelConfig, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Load the tensors `cfg` needs from a .safetensors file or a directory of shards.
    Raises CheckpointError listing every missing tensor, or on the first mis-shaped one."""
    device = torch.device(device)
    want = weight_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in want and name not in out:
                    out[name] = _read_tensor(f, name, want[name], cfg, device)
    missing = [n for n in want if n not in out]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" ... ({len(missing)} in all)" if len(missing) > 8 else ""
        )
        raise CheckpointError(f"checkpoint {path} lacks tensors: {shown}")
    return out


def checkpoint_layers(path: str | Path) -> int:
    """Decoder layers a checkpoint holds: n such that layers 0 .. n-1 all have tensors (reads
    the files' headers only)."""
    found = set()
    for file in _checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                m = re.match(r"model\.layers\.(\d+)\.", name)
                if m:
                    found.add(int(m.group(1)))
    n = 0
    while n in found:
        n += 1
    return n


def save_safetensors(weights: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write the weights as one .safetensors file under their checkpoint names."""
    save_file({n: t.detach().contiguous().cpu() for n, t in weights.items()}, str(path))


def check_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Raise CheckpointError unless `weights` has every tensor of `cfg` with the right shape."""
    want = weight_shapes(cfg)
    missing = [n for n in want if n not in weights]
    if missing:
        raise CheckpointError(f"weights lack {len(missing)} tensors, first {missing[0]}")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(
                f"{name}: expected shape {shape}, got {tuple(weights[name].shape)}"
            )

"""Presets, seeded random weights, and the safetensors loader under DeepSeek-V3.2 tensor names."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine_client.kv.baseline import BaselineBackend, baseline_layout
from engine_client.model.model import Model
from engine_client.model.preset import PRESETS, ConfigError, ModelConfig, preset
from engine_client.model.weights import (
    CheckpointError,
    load_safetensors,
    random_weights,
    save_safetensors,
    weight_shapes,
)
from kernels.kit.kernel_set import KernelSet

CFG = preset("tiny", topk=8)


def test_presets_validate() -> None:
    assert set(PRESETS) == {"tiny", "bench", "v32"}
    v32 = preset("v32")
    # Every preset's vocabulary is its tokenizer's, rounded as V3.2 rounds it.
    assert v32.vocab_size == preset("bench").vocab_size == 129_280
    assert preset("tiny").vocab_size == 1024
    assert (v32.num_heads, v32.q_lora_rank, v32.index_heads, v32.topk, v32.num_layers) == (
        128,
        1536,
        64,
        2048,
        61,
    )
    assert preset("bench", num_layers=2).num_layers == 2
    for bad in (
        {"kv_lora_rank": 256},
        {"rope_dim": 32},
        {"index_dim": 64},
        {"num_heads": 0},
        {"mlp_hidden": -1},
        {"dtype": "fp16"},
    ):
        with pytest.raises(ConfigError):
            CFG.replace(**bad)
    with pytest.raises(ConfigError):
        preset("huge")
    with pytest.raises(Exception):
        CFG.num_layers = 3  # frozen


def test_bench_preset_reads_about_1_4_gb_per_layer() -> None:
    cfg = preset("bench")
    shapes = weight_shapes(cfg)
    layer = sum(torch.Size(s).numel() for n, s in shapes.items() if n.startswith("model.layers.0."))
    assert 1.38e9 < 2 * layer < 1.45e9


def test_random_weights_are_seeded_and_per_tensor() -> None:
    a, b = random_weights(CFG, seed=1), random_weights(CFG, seed=1)
    assert all(torch.equal(a[n], b[n]) for n in a)
    c = random_weights(CFG, seed=2)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    # A tensor does not depend on how many layers there are.
    one = random_weights(CFG.replace(num_layers=1), seed=1)
    assert torch.equal(
        one["model.layers.0.self_attn.q_b_proj.weight"],
        a["model.layers.0.self_attn.q_b_proj.weight"],
    )
    assert set(a) == set(weight_shapes(CFG))
    assert all(t.dtype == torch.bfloat16 and torch.isfinite(t.float()).all() for t in a.values())


def prefill_logits(weights) -> torch.Tensor:
    backend = BaselineBackend(
        baseline_layout(num_layers=2, max_requests=1, max_context=8, topk=8, page_size=4),
        kernels=KernelSet.triton(),
    )
    return Model(CFG, weights, backend).prefill(0, [3, 1, 4], chunk_size=3)


def test_checkpoint_round_trip_gives_same_logits(tmp_path) -> None:
    weights = random_weights(CFG, seed=5)
    path = tmp_path / "model.safetensors"
    save_safetensors(weights, path)
    loaded = load_safetensors(path, CFG)
    assert all(torch.equal(weights[n], loaded[n]) for n in weights)
    assert torch.equal(prefill_logits(weights), prefill_logits(loaded))


def test_sharded_checkpoint_with_index_and_extra_tensors(tmp_path) -> None:
    weights = random_weights(CFG, seed=5)
    names = sorted(weights)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    extra = {"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(2, 2)}
    for i, (file, part) in enumerate(shards.items()):
        tensors = {n: weights[n].float() for n in part} | (extra if i == 0 else {})
        save_file(tensors, str(tmp_path / file))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_safetensors(tmp_path, CFG)
    # fp32 in the checkpoint is cast to the model dtype; unused tensors are ignored.
    assert set(loaded) == set(weights)
    assert all(
        loaded[n].dtype == torch.bfloat16 and torch.equal(loaded[n], weights[n]) for n in weights
    )


def test_bad_checkpoints_are_refused(tmp_path) -> None:
    weights = random_weights(CFG, seed=5)
    cases = {
        "missing": {
            n: t for n, t in weights.items() if n != "model.layers.1.self_attn.o_proj.weight"
        },
        "shape": weights | {"model.layers.0.self_attn.kv_b_proj.weight": torch.zeros(3, 512)},
        "dtype": weights | {"model.norm.weight": torch.zeros(CFG.hidden_size, dtype=torch.int32)},
    }
    messages = {
        "missing": "model.layers.1.self_attn.o_proj.weight",
        "shape": "kv_b_proj.weight: expected shape",
        "dtype": "model.norm.weight",
    }
    for case, tensors in cases.items():
        path = tmp_path / f"{case}.safetensors"
        save_safetensors(tensors, path)
        with pytest.raises(CheckpointError, match=messages[case]):
            load_safetensors(path, CFG)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_safetensors(tmp_path / "nope", CFG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_safetensors(tmp_path / "empty", CFG)
    with pytest.raises(CheckpointError):
        Model(
            CFG,
            cases["missing"],
            BaselineBackend(
                baseline_layout(num_layers=2, max_requests=1, max_context=8, topk=8),
                kernels=KernelSet.triton(),
            ),
        )


def test_model_config_is_frozen_dataclass() -> None:
    cfg = ModelConfig(vocab_size=10, hidden_size=8, num_layers=1)
    assert cfg.row_dim == 576 and cfg.qk_head_dim == 192
    assert cfg.index_weight_scale == pytest.approx((64 * 128) ** -0.5)

"""bench.profile: the per-kernel breakdown of a decode step, end to end on a tiny preset."""

from __future__ import annotations

import json

import pytest
import torch

from bench.profile.breakdown import main
from bench.profile.parts import PART_FAMILIES, family
from bench.shared.kernel_names import CATEGORIES, category, kernel_kind

# Every layer of every step runs these (the shared phase only with a shared region).
KERNEL_CATEGORIES = [c for c, _ in CATEGORIES if c not in ("MLP/GEMM", "plan: shared phase")]


def test_kernel_names_fall_in_their_categories():
    names = {
        "_miss_copy_kernel": "miss copy",
        "kernel::miss_copy": "miss copy",
        "_swap_plan_kernel": "plan",
        "shared_victims_kernel": "plan: shared phase",
        "shared_lookup_kernel": "plan: shared phase",
        "_kv_append_kernel": "append",
        "_indexer_kernel": "indexer",
        "kernel::indexer_scores": "indexer",
        "_compact_kernel": "top-k",
        "kernel::topk_select": "top-k",
        "_sparse_mla_decode_kernel": "attention",
        "_combine_kernel": "attention",
        "sm90_xmma_gemm_bf16bf16_bf16f32": "MLP/GEMM",
        "nvjet_tst_128x64": "MLP/GEMM",
        "aten::mm": "MLP/GEMM",
        "aten::mm_out_extra": "other",
        "void at::native::vectorized_elementwise_kernel": "other",
    }
    assert {n: category(n) for n in names} == names


def test_kernels_fall_in_the_family_of_their_part():
    """Kernels of ours keep their name's category; PyTorch's go to the innermost part, GEMMs
    split from the rest; outside every part, to their kernel kind."""
    mm = "sm90_xmma_gemm_bf16bf16_bf16f32"
    ew = "void at::native::vectorized_elementwise_kernel<4, MulFunctor>"
    cases = [
        ("_miss_copy_kernel", ["append", "block"], "miss copy"),
        (mm, ["attention", "block", "embed", "step"], PART_FAMILIES["attention"][0]),
        (ew, ["attention", "block"], PART_FAMILIES["attention"][1]),
        (ew, ["norm", "attention", "block"], "norms"),
        (mm, ["block", "embed"], "MLP/GEMM"),
        (mm, ["indexer_qkw", "attention"], "indexer q/k/w projections"),
        (mm, ["logits", "step"], "logits (lm_head)"),
        ("aten::cat", ["unknown part"], "outside the model: cat"),
        ("Memcpy HtoD (Pinned -> Device)", [], "outside the model: copy/cast"),
    ]
    assert [family(k, p) for k, p, _ in cases] == [f for *_, f in cases]


def test_kernel_kinds():
    kinds = {
        "void at::native::reduce_kernel<512, 1, MeanOps>": "reduce",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "cat",
        "void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>": "copy/cast",
        "void at::native::vectorized_elementwise_kernel<4, AddFunctor>": "elementwise",
        "void at::native::vectorized_layer_norm_kernel<float>": "layer norm",
        "void at::native::index_elementwise_kernel<128, 4>": "index/gather",
        "nvjet_tst_64x8": "GEMM",
        "mystery": "unnamed",
    }
    assert {n: kernel_kind(n) for n in kinds} == kinds


def _run(tmp_path, mode: str, *extra: str) -> dict:
    out = tmp_path / f"{mode}.json"
    args = [
        "--preset",
        "tiny",
        "--context",
        "80",
        "--batch",
        "3",
        "--mode",
        mode,
        "--warmup",
        "3",
        "--steps",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
        *extra,
    ]
    assert main(args) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_embedded_step_breakdown(tmp_path):
    r = _run(tmp_path, "embedded")
    cats, n, L = r["categories"], 3, r["num_layers"]
    for cat in KERNEL_CATEGORIES:  # every swap-in and attention kernel runs every layer
        assert cats[cat]["us_per_step"] > 0, cat
    for v in cats.values():
        assert v["us_per_request_layer"] == pytest.approx(v["us_per_step"] / (n * L))
        assert v["share"] == pytest.approx(v["us_per_step"] / r["step_us"])
    # The replayed trace moves its selections, so a warm step still misses some rows.
    assert 0 < r["miss_rows_per_step"] <= n * L * 16
    assert r["miss_rate"] == pytest.approx(r["miss_rows_per_step"] / (n * L * 16))
    assert r["miss_copy_gbs"] > 0 and r["pinned_h2d_gbs"] is None
    fams = r["families"]  # the eager pass names the model's parts
    for fam in ("norms", "rope", "quantize index keys", "MLP/GEMM", "logits (lm_head)"):
        assert fams[fam]["us_per_step"] > 0, fam
    assert PART_FAMILIES["attention"][0] in fams and "miss copy" in fams
    # HiSparse's select launches only the plan and the copy: the plan kernel counts (issue 38).
    assert "select: hit/miss counters" not in fams and fams["select: row bases"]["us_per_step"] > 0


@pytest.mark.slow
def test_part_tail_step_breakdown(tmp_path):
    """--decode-part-tail (gpu_session.sh PROFILES fp8:222:2:--decode-part-tail): the MLP runs
    inside the attention's part and is still charged to the MLP, its projections to MLA's."""
    r = _run(tmp_path, "embedded", "--microbatches", "2", "--decode-part-tail")
    assert r["args"]["decode_part_tail"] and r["miss_rows_per_step"] > 0
    fams = r["families"]
    assert fams["MLP/GEMM"]["us_per_step"] > 0 and fams["MLP elementwise (silu, mul, add)"]
    assert fams[PART_FAMILIES["attention"][0]]["us_per_step"] > 0


@pytest.mark.slow
def test_shared_prefix_step_reads_the_region(tmp_path):
    """--shared-prefix/--shared-slots (issue 40's capacity runs, profiled): every request's
    first pages are one cached prefix whose rows the shared hot region holds once."""
    page = ["--page-size", "8", "--no-families", "--shared-prefix", "48"]
    r = _run(tmp_path, "embedded", *page, "--shared-slots", "64")
    assert r["args"]["shared_slots"] == 64 and r["categories"]["plan"]["us_per_step"] > 0
    # The region holds prefix rows (selected by three requests, each at most once a layer).
    assert 0 < r["shared_rows_live"] <= 64 * r["num_layers"]
    assert _run(tmp_path, "embedded", *page)["shared_rows_live"] is None
    with pytest.raises(SystemExit):  # a region without a prefix to hold
        _run(tmp_path, "embedded", "--page-size", "8", "--shared-slots", "64")


@pytest.mark.slow
def test_baseline_has_no_swap_in(tmp_path):
    r = _run(tmp_path, "baseline")
    cats = r["categories"]
    assert cats["miss copy"]["us_per_step"] == 0 and cats["plan"]["us_per_step"] == 0
    assert cats["attention"]["us_per_step"] > 0 and cats["indexer"]["us_per_step"] > 0
    assert r["miss_rows_per_step"] == 0 and r["miss_copy_gbs"] is None


@pytest.mark.gpu
def test_graphed_step_on_gpu(tmp_path):
    """On CUDA the profiled step is the captured graph: Triton kernels show by name."""
    out = tmp_path / "gpu.json"
    assert (
        main(
            [
                "--preset",
                "tiny",
                "--context",
                "300",
                "--batch",
                "4",
                "--warmup",
                "3",
                "--steps",
                "2",
                "--no-ceilings",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert torch.cuda.is_available() and r["device"] != "cpu"
    for cat in KERNEL_CATEGORIES:
        assert r["categories"][cat]["us_per_step"] > 0, cat
    assert r["miss_rows_per_step"] > 0 and r["miss_copy_gbs"] > 0
    # The eager pass links PyTorch's kernels to their launching ops, hence to parts.
    for fam in ("norms", "rope", "MLP/GEMM", "attention"):
        assert r["families"][fam]["us_per_step"] > 0, fam

"""Host reads (KVLayout.host_reads, issue 40): a private hot buffer below W + k, whose misses past
the victims attention reads from the host tier (plan entries -2 - row), still gives logits
bitwise equal to the all-on-GPU baseline, in process (embedded, remote swap) and on the GPU with
graphs and micro-batches. CPU: Triton's interpreter, the shapes of test_model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from contract.layout import KVLayout
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig, ModelRunner
from engine_client.model.weights import random_weights
from kernels.kit.kernel_set import KernelSet
from tests.engine_client.model.test_model import (
    CFG,
    GPU_CFG,
    GPU_LAYOUT,
    LAYOUT,
    gpu_run,
    make_backend,
    run_scenario,
)


def small_buffer(layout: KVLayout, private: int) -> KVLayout:
    return dataclasses.replace(layout, hot_slots=layout.window + private, host_reads=True)


class HostEntries:
    """The swap plan, counting the host-read entries (<= -2) it hands attention."""

    def __init__(self, plan) -> None:
        self.plan, self.count = plan, 0

    def __call__(self, *args, **kw) -> None:
        self.plan(*args, **kw)
        self.count += int((args[10] < -1).sum())  # out_slots: after layer and 9 inputs


def run(mode: str, layout: KVLayout, weights) -> tuple[list[torch.Tensor], HostEntries]:
    spy = HostEntries(KernelSet.triton().swap_plan)
    kernels = dataclasses.replace(KernelSet.triton(), swap_plan=spy)
    backend = make_backend(mode, kernels, layout)
    model = Model(CFG, weights, backend)
    runner = ModelRunner(model, DecodeConfig(max_batch=4, buckets=(4,)))
    return run_scenario(model, runner), spy


@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_a_buffer_below_w_plus_k_matches_the_baseline(row_format) -> None:
    weights = random_weights(CFG, seed=3)
    layout = dataclasses.replace(LAYOUT, row_format=row_format)
    base, _ = run("baseline", layout, weights)
    modes = ("embedded", "remote") if row_format == "bf16" else ("embedded",)
    for mode in modes:
        got, spy = run(mode, small_buffer(layout, LAYOUT.topk // 2), weights)
        assert spy.count > 0, "no miss was read from the host tier: the test proves nothing"
        for i, (a, b) in enumerate(zip(base, got)):
            assert torch.equal(a, b), f"{mode} {row_format}: output {i} differs"


def test_without_host_reads_the_small_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="host_reads"):
        dataclasses.replace(LAYOUT, hot_slots=LAYOUT.window + LAYOUT.topk // 2)


@pytest.mark.gpu
@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
def test_gpu_host_reads_match_the_baseline(row_format) -> None:
    """A private buffer of W + k / 2 on bench shapes: eager, graphs, two micro-batches (the
    side-stream copy beside attention's host reads), remote swap."""
    layout = dataclasses.replace(GPU_LAYOUT, row_format=row_format)
    weights = random_weights(GPU_CFG, seed=0, device="cuda")
    ref = gpu_run("baseline", False, weights, layout)
    small = small_buffer(layout, layout.topk // 2)
    for mode, graphs, parts in (
        ("embedded", False, 1),
        ("embedded", True, 1),
        ("embedded", True, 2),
        ("remote", True, 1),
    ):
        got = gpu_run(mode, graphs, weights, small, tail_parts=parts)
        for i, (a, b) in enumerate(zip(ref, got)):
            assert torch.equal(a, b), f"{mode} graphs={graphs} parts={parts}: output {i} differs"

"""The engine's compute: model, KV backend and model runner for one KV mode. Everything here runs
on the engine's single compute thread.

`build_compute` picks the backend by mode:
- baseline: `BaselineBackend`, all KV on the device (no service);
- embedded / service: `HiSparseBackend` on the KVTensors (allocated locally / mapped);
- service-remote-swap: `RemoteSwapBackend`, whose per-layer swap is `swap_fn` (the RemoteSwap RPC).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging

import torch

from contract.errors import LayoutMismatch
from contract.layout import KVLayout
from contract.tensors import KVTensors
from engine_client.kv.backend import KVBackend
from engine_client.kv.baseline import BaselineBackend
from engine_client.kv.hisparse import OVERLAP_COPY_GRID, HiSparseBackend
from engine_client.kv.remote_swap import RemoteSwapBackend, SwapFn
from engine_client.model.attention import TopkSource
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig, ModelRunner
from engine_client.model.preset import ModelConfig
from engine_client.model.speculative_runner import SpeculativeModelRunner
from kernels.kit.kernel_set import KernelSet
from kernels.swap.copy_grid import CopyGrid

log = logging.getLogger(__name__)


class Compute:
    """What one engine runs on its compute thread: the model, its model runner (static
    buffers, CUDA graphs), the KV backend (with its per-slot swap counts), and the prefill
    sizes. The steps themselves are launched by engine_client.loop.step_runner.StepRunner."""

    def __init__(
        self,
        model: Model,
        model_runner: ModelRunner,
        backend: KVBackend,
        layout: KVLayout,
        prefill_chunk: int,
        synthetic_context: int = 0,
        synthetic_shared: int = 0,
        draft_tokens: int = 0,
    ) -> None:
        self.model, self.model_runner, self.backend = model, model_runner, backend
        # Speculative decoding: drafts per verify step (then a SpeculativeModelRunner), or 0.
        self.draft_tokens = draft_tokens
        self.layout = layout
        self.prefill_chunk = prefill_chunk
        self.row_bytes = layout.row_bytes
        # Prompts start with this many placeholder tokens whose KV is filled synthetically.
        self.synthetic_context = synthetic_context
        # ... of which the first `synthetic_shared` are the same for every request.
        self.synthetic_shared = synthetic_shared

    @property
    def max_batch(self) -> int:
        return self.model_runner.cfg.max_batch

    def bind_kv(self, tensors: KVTensors | None, exchange: dict) -> None:
        """Point the backend at a restarted service's memory, or (None) at nothing once the
        service is lost. Captured graphs hold the old addresses: dropped first (with their
        pool), recaptured on use."""
        self.model_runner.drop_graphs()
        self.backend.rebind(tensors, exchange or None)


def build_backend(
    mode: str,
    layout: KVLayout,
    tensors: KVTensors | None,
    kernels: KernelSet,
    max_batch: int,
    device: str,
    swap_fn: SwapFn | None,
    exchange: dict | None,
    microbatches: int = 1,
    page_table: torch.Tensor | None = None,
    rows_per_request: int = 1,
    copy_grid: CopyGrid = OVERLAP_COPY_GRID,
) -> KVBackend:
    """page_table: the baseline's, when its control maps pages (prefix caching);
    rows_per_request: the most decode rows per request a step has (a verify step's D + 1);
    copy_grid: the launch of the HiSparse backend's side-stream miss copy (side_copy_grid)."""
    if mode == "baseline":
        return BaselineBackend(layout, kernels=kernels, device=device, page_table=page_table)
    if tensors is None:
        raise ValueError(f"kv mode {mode} needs the KV tensors")
    if mode == "service-remote-swap":
        if swap_fn is None:
            raise ValueError("service-remote-swap needs a swap function")
        return RemoteSwapBackend(
            tensors,
            swap_fn,
            kernels=kernels,
            xchg=exchange or None,
            max_batch=max_batch,
            rows_per_request=rows_per_request,
        )
    return HiSparseBackend(
        tensors,
        kernels=kernels,
        max_batch=max_batch,
        microbatches=microbatches,
        rows_per_request=rows_per_request,
        copy_grid=copy_grid,
    )


def side_copy_grid(spec: str, priority: int) -> CopyGrid:
    """The side-stream copy's launch from the engine's settings: the spec's (--decode-copy-grid;
    its `default` and "" are the backend's OVERLAP_COPY_GRID) on a stream of the given priority
    (--decode-copy-priority)."""
    grid = CopyGrid.parse(spec, default=OVERLAP_COPY_GRID) if spec else OVERLAP_COPY_GRID
    return dataclasses.replace(grid, priority=priority)


def load_topk_source(
    spec: str, model_cfg: ModelConfig, layout: KVLayout, device: str
) -> TopkSource | None:
    """None for "indexer"; else MODULE:FUNC[:JSON kwargs], called as
    FUNC(model_cfg, layout, device, **kwargs) -> TopkSource (benchmarks: bench.shared.trace)."""
    if spec == "indexer":
        return None
    module, func, *rest = spec.split(":", 2)
    kwargs = json.loads(rest[0]) if rest else {}
    return getattr(importlib.import_module(module), func)(model_cfg, layout, device, **kwargs)


def build_compute(
    model: Model,
    layout: KVLayout,
    max_batch: int,
    prefill_chunk: int,
    use_graphs: bool = True,
    topk_source: TopkSource | None = None,
    synthetic_context: int = 0,
    synthetic_shared: int = 0,
    draft_tokens: int = 0,
) -> Compute:
    """The compute of `model` (over its backend): its runner, graphed unless use_graphs is
    False; draft_tokens > 0: speculative decoding with the model's MTP layer drafting."""
    model.topk_source = topk_source  # before capture: the graphs must contain it
    dcfg = DecodeConfig(max_batch, use_graphs=use_graphs)
    model_runner = (
        SpeculativeModelRunner(model, dcfg, draft_tokens)
        if draft_tokens
        else ModelRunner(model, dcfg)
    )
    if model_runner.use_graphs:
        model_runner.capture()
        log.info("captured decode graphs for batch buckets %s", model_runner.cfg.buckets)
    return Compute(
        model,
        model_runner,
        model.backend,
        layout,
        prefill_chunk,
        synthetic_context=synthetic_context,
        synthetic_shared=synthetic_shared,
        draft_tokens=draft_tokens,
    )


def check_model_fits(model_cfg: ModelConfig, layout: KVLayout, draft_tokens: int = 0) -> None:
    """The layout must be the model's: same layers (the MTP layer's included) and top-k (the
    row and index formats are the layout's alone: the model hands its backend bf16 rows and
    keys); speculative steps need their union and window to fit (KVLayout.check_draft_tokens)."""
    if layout.num_layers != model_cfg.kv_layers or layout.topk != model_cfg.topk:
        raise LayoutMismatch(
            f"KV layout (layers {layout.num_layers}, top-k {layout.topk}) does not "
            f"fit the model (layers {model_cfg.num_layers} + {model_cfg.mtp_layers} MTP, "
            f"top-k {model_cfg.topk})"
        )
    if draft_tokens:
        try:
            log.info("%s", layout.check_draft_tokens(draft_tokens))
        except ValueError as e:
            raise LayoutMismatch(str(e)) from e

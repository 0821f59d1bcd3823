"""The compute of one KV mode: weights, the mode's attention backend over the KV control's
memory, the top-k source, and the one thread every model call runs on.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from engine_client.client.control import KVControl
from engine_client.client.kv_client import KVClient
from engine_client.kv.backend import KVBackend
from engine_client.model.compute import (
    build_backend,
    build_compute,
    check_model_fits,
    load_topk_source,
    side_copy_grid,
)
from engine_client.model.model import Model
from engine_client.model.preset import ModelConfig
from engine_client.model.weights import load_safetensors, random_weights
from engine_client.serve.config import EngineConfig
from kernels.kit.kernel_set import KernelSet


def compute_thread(device: str) -> ThreadPoolExecutor:
    # Triton launches on the thread's current CUDA device: pin the compute thread to ours.
    # "cuda" (--device cuda/auto) has no index: it means the current device, 0.
    init = (
        (lambda: torch.cuda.set_device(torch.device(device).index or 0))
        if device.startswith("cuda")
        else None
    )
    return ThreadPoolExecutor(1, thread_name_prefix="engine-compute", initializer=init)


def _backend(
    cfg: EngineConfig, control: KVControl, kernels: KernelSet, max_batch: int, device: str
) -> KVBackend:
    """The KV mode's attention backend over the control's memory: remote-swap steps swap through
    the service, the baseline reads its page table."""
    swap_fn = exchange = None
    if isinstance(control, KVClient) and cfg.kv.kv_mode == "service-remote-swap":
        swap_fn, exchange = (
            (lambda layer, bs, rows: control.remote_swap(layer, bs, rows)),
            control.exchange,
        )
    # The baseline's control maps its pages (a prefill engine's wraps it: ExportControl).
    page_table = getattr(control, "page_table", None) if cfg.kv.kv_mode == "baseline" else None
    return build_backend(
        cfg.kv.kv_mode,
        control.layout,
        control.tensors,
        kernels,
        max_batch,
        device,
        swap_fn,
        exchange,
        cfg.batching.decode_microbatches,
        page_table,
        rows_per_request=cfg.speculation.spec_tokens + 1,
        copy_grid=side_copy_grid(cfg.batching.decode_copy_grid, cfg.batching.decode_copy_priority),
    )


def build_mode_compute(cfg: EngineConfig, mcfg: ModelConfig, control: KVControl, device: str):
    """The model over the KV mode's backend, run on the compute thread (it may load weights
    and build CUDA graphs)."""
    spec = cfg.speculation.spec_tokens
    # The all-on-GPU baseline has no hot buffers for the verify rows to share.
    check_model_fits(mcfg, control.layout, spec if cfg.kv.kv_mode != "baseline" else 0)
    kernels = KernelSet.choose(cfg.execution.kernels, device.split(":")[0])
    weights = (
        load_safetensors(cfg.model.checkpoint, mcfg, device)
        if cfg.model.checkpoint
        else random_weights(mcfg, cfg.model.weight_seed, device)
    )
    max_batch = min(cfg.batching.max_batch, control.layout.max_requests)
    backend = _backend(cfg, control, kernels, max_batch, device)
    source = load_topk_source(cfg.benchmark.topk_source, mcfg, control.layout, device)
    model = Model(
        mcfg,
        weights,
        backend,
        batch_invariant=cfg.execution.batch_invariant,
        tail_parts=tail_parts(cfg),
        late_queries=cfg.batching.decode_late_queries,
    )
    return build_compute(
        model,
        control.layout,
        max_batch,
        cfg.batching.prefill_chunk,
        use_graphs=cfg.execution.cuda_graphs,
        topk_source=source,
        synthetic_context=cfg.benchmark.synthetic_context,
        synthetic_shared=cfg.benchmark.synthetic_shared,
        draft_tokens=spec,
    )


def tail_parts(cfg: EngineConfig) -> int:
    """The model's decode tail parts: the micro-batch count in every KV mode (the baseline's and
    remote swap's backends run one part, but their GEMMs must split as the others' do)."""
    return cfg.batching.decode_microbatches if cfg.batching.decode_part_tail else 1

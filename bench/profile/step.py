"""The decode step bench.profile and bench.profile.copy_sweep measure: the engine's model, graphed
runner and KV backend at `batch` requests of `context` synthetic tokens, stepped at consecutive
positions, and timed."""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from torch.profiler import record_function

from bench.profile.parts import KERNEL_RANGE
from bench.shared.attention_args import attention_kernels
from bench.shared.copy_args import copy_grid, copy_kernels
from bench.shared.glue_args import glue_kernels
from bench.shared.indexer_args import indexer_kernels
from contract.layout import MODE_OFFLOADED, KVLayout, needs_host_reads
from engine_client.kv.baseline import BaselineBackend
from engine_client.kv.hisparse import HiSparseBackend
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig, ModelRunner
from engine_client.model.preset import preset
from engine_client.model.weights import random_weights
from kernels.kit.kernel_set import KernelSet
from kv_service.memory.store import allocate_local, reset_request


def named_kernels(ks: KernelSet) -> KernelSet:
    """The same kernels, each call inside a `kernel::<name>` profiler range (eager runs only)."""

    def wrap(name, fn):
        def call(*a, **kw):
            with record_function(KERNEL_RANGE + name):
                return fn(*a, **kw)

        return call

    fields = [f.name for f in dataclasses.fields(ks) if f.name != "capturable"]
    return dataclasses.replace(ks, **{n: wrap(n, getattr(ks, n)) for n in fields})


def build(args: argparse.Namespace, device: torch.device, positions: int = 0):
    """Model, runner and backend at `batch` requests of `context` synthetic tokens, with room
    for `positions` decode steps [the warm-up, timed and profiled steps of args]."""
    over = {"num_layers": args.layers} if args.layers else {}
    cfg = preset(args.preset, **over)
    kernels, graphed = _kernels(args, device)
    lay = _layout(args, cfg, positions)
    if args.mode == "baseline":
        backend = BaselineBackend(lay, kernels=kernels, device=device)
    else:
        backend = offloaded_backend(
            lay,
            args.batch,
            device,
            shared_prefix=args.shared_prefix,
            kernels=kernels,
            microbatches=args.microbatches,
            copy_grid=copy_grid(args),
        )
    for slot in range(args.batch):  # the shared prefix's pages once, by the first request
        start = args.shared_prefix if slot else 0
        backend.fill_synthetic(slot, args.context, seed=slot, start=start)
    # The part tail splits as the engine's does: into the micro-batch count, in either mode.
    tail = args.microbatches if args.decode_part_tail else 1
    weights = random_weights(cfg, seed=0, device=device)
    model = Model(cfg, weights, backend, tail_parts=tail, late_queries=args.late_queries)
    if args.topk_source == "trace":
        from bench.shared.trace import trace_source

        model.topk_source = trace_source(cfg, lay, str(device))
    runner = ModelRunner(
        model, DecodeConfig(max_batch=args.batch, buckets=(args.batch,), use_graphs=graphed)
    )
    return cfg, lay, backend, runner


def _kernels(args: argparse.Namespace, device: torch.device) -> tuple[KernelSet, bool]:
    """The step's kernel set as the options configure it, and whether the step is graphed
    (eager steps name each kernel call for the profile)."""
    use_triton = args.kernels == "triton" or (args.kernels == "auto" and device.type == "cuda")
    kernels = KernelSet.triton() if use_triton else KernelSet.reference()
    graphed = device.type == "cuda" and kernels.capturable
    kernels = indexer_kernels(attention_kernels(copy_kernels(kernels, args), args), args)
    kernels = glue_kernels(kernels, args)
    return (kernels if graphed else named_kernels(kernels)), graphed


def _layout(args: argparse.Namespace, cfg, positions: int) -> KVLayout:
    P = args.page_size
    # Decode positions: warm-up, timed, profiled, (fallback) eager-profiled and families steps.
    positions = positions or args.warmup + 4 * args.steps + 8
    max_ctx = -(-(args.context + positions) // P) * P
    window = args.window or min(128, cfg.topk // 2)
    B, shared = args.hot_slots or 2 * cfg.topk, args.shared_prefix // P
    return KVLayout(
        num_layers=cfg.num_layers,
        max_requests=args.batch + args.shared_slots // B,  # the region's buffers come last
        hot_slots=B,
        window=window,
        topk=cfg.topk,
        page_size=P,
        num_pages=args.batch * (max_ctx // P - shared) + shared,
        max_context=max_ctx,
        index_format="fp8",
        row_format=args.row_format,
        shared_slots=args.shared_slots,
        host_reads=needs_host_reads(B, window, cfg.topk),  # below W + k: overflow from the host
    )


def offloaded_backend(
    lay: KVLayout, batch: int, device, shared_prefix: int = 0, **options
) -> HiSparseBackend:
    """An embedded HiSparse backend whose `batch` request slots each own an equal share of the
    pages after the first `shared_prefix` tokens' pages, which they all share as a cached
    prefix (read through the layout's shared hot region when it has one); `options`: the
    backend's own."""
    kv = allocate_local(lay, device)
    common = list(range(shared_prefix // lay.page_size))
    per = (lay.num_pages - len(common)) // batch
    for slot in range(batch):
        own = range(len(common) + slot * per, len(common) + (slot + 1) * per)
        reset_request(kv, slot, MODE_OFFLOADED, common + list(own))
        if kv.shared is not None:  # rows below shared_len are the prefix's: the region's
            kv.shared.shared_len[slot] = shared_prefix
    return HiSparseBackend(kv, **options)


class Stepper:
    """Decode steps of every request slot at consecutive positions after the context."""

    def __init__(self, runner: ModelRunner, batch: int, context: int) -> None:
        self.runner, self.batch, self.pos = runner, batch, context
        self.slots, self.tokens = list(range(batch)), [1] * batch

    def __call__(self, n: int) -> None:
        for _ in range(n):
            pos = [self.pos] * self.batch
            self.runner.step(self.tokens, pos, self.slots, [p + 1 for p in pos])
            self.pos += 1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def misses_so_far(backend) -> int:
    return int(backend.stats().get("misses", 0))


def step_seconds(step: Stepper, n: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    step(n)
    sync(device)
    return (time.perf_counter() - t0) / n

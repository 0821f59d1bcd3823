"""Assemble an engine from its config: the KV control of the mode, weights, backend, compute,
and (service modes with a state file) the requests of the previous engine process.

Resume after an engine restart: the state file names the KV session of the previous process.
The new engine attaches with that session id; the service hands back the requests it still
holds (within its lease), and every one the state file also knows continues where it was: its
KV is in the service's memory, its tokens and sampling seed in the file. Requests the service
holds but the file does not know are released; requests the file knows but the service lost
cannot be resumed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import torch

from contract import residency
from contract.layout import KVLayout
from engine_client.client import errors, reachability
from engine_client.client.control import HeldRequest, KVControl
from engine_client.client.kv_client import KVClient
from engine_client.kv.local_control import BaselineControl, BaselinePages, EmbeddedControl
from engine_client.loop import state_file
from engine_client.loop.engine import Engine
from engine_client.loop.metrics import EngineMetrics
from engine_client.loop.queue_policy import queue_policy
from engine_client.loop.request import GenRequest, Phase
from engine_client.loop.scheduler import QueueLimits
from engine_client.model.compute import (
    build_backend,
    build_compute,
    check_model_fits,
    choose_kernels,
    load_draft_source,
    load_topk_source,
)
from engine_client.model.preset import TOKENIZERS, ModelConfig, preset
from engine_client.model.weights import (
    checkpoint_layers,
    load_safetensors,
    model_fingerprint,
    random_weights,
)
from engine_client.serve.config import EngineConfig
from engine_client.text import vocabulary
from engine_client.text.detokenizer import TextStream

log = logging.getLogger(__name__)

# How long an embedded core keeps a session without a stream; the engine is its only user.
EMBEDDED_LEASE_SECONDS = 30.0


def load_vocabulary(cfg: EngineConfig) -> vocabulary.Vocabulary:
    """--tokenizer, else the preset's."""
    return vocabulary.load(cfg.tokenizer or TOKENIZERS[cfg.preset])


def model_config(
    cfg: EngineConfig, vocab: vocabulary.Vocabulary, layout: KVLayout | None = None
) -> ModelConfig:
    """The preset with --num-layers, the vocabulary size of `vocab` (and the MTP layer with
    --speculative mtp). In service modes the service's `layout` decides the layers and top-k,
    which the model adopts; a model that cannot take them (another --num-layers, a checkpoint
    with fewer layers) is refused with both values named. With --speculative mtp the layer
    count is checked, not adopted: the layout must hold the model's decoder layers and, last,
    the MTP layer's (a layout sized for the model alone would otherwise silently lose a decoder
    layer to the MTP layer)."""
    mtp = 1 if cfg.spec_tokens else 0
    overrides: dict = {"vocab_size": vocab.model_vocab_size, "mtp_layers": mtp}
    if cfg.num_layers:
        overrides["num_layers"] = cfg.num_layers
    mcfg = preset(cfg.preset, **overrides)
    if layout is None:
        return mcfg
    if mtp and layout.num_layers != mcfg.kv_layers:
        raise errors.LayoutMismatch(
            f"--speculative mtp needs a KV layout of the model's {mcfg.num_layers} decoder "
            f"layers + 1 MTP layer = {mcfg.kv_layers} layers, the KV service's has "
            f"{layout.num_layers} (start it with --num-layers {mcfg.kv_layers})"
        )
    if cfg.num_layers is not None and cfg.num_layers != layout.num_layers - mtp:
        raise errors.LayoutMismatch(
            f"the engine was started with --num-layers {cfg.num_layers} but the KV service's "
            f"layout has {layout.num_layers} layers (leave --num-layers out to adopt it)"
        )
    if cfg.checkpoint and (held := checkpoint_layers(cfg.checkpoint)) < layout.num_layers:
        raise errors.LayoutMismatch(
            f"the checkpoint {cfg.checkpoint} holds {held} layers but the KV service's layout "
            f"has {layout.num_layers} layers"
        )
    return mcfg.replace(num_layers=layout.num_layers - mtp, topk=layout.topk)


def fingerprint(cfg: EngineConfig, mcfg: ModelConfig) -> str:
    """The model fingerprint given at attach: the prefix cache's namespace ("" turns it off)."""
    if not cfg.prefix_cache:
        return ""
    return cfg.model_fingerprint or model_fingerprint(mcfg, cfg.checkpoint, cfg.weight_seed)


async def connect_service(
    cfg: EngineConfig, saved: state_file.SavedState, model_fingerprint: str = ""
) -> KVClient:
    """Attach to the service, resuming the saved session if the service still has it."""
    kwargs: dict[str, Any] = dict(
        model_fingerprint=model_fingerprint,
        engine_name=cfg.engine_name,
        token=cfg.token,
        rpc_timeout=cfg.rpc_timeout,
        attach_timeout=cfg.attach_timeout,
        heartbeat_interval=cfg.heartbeat_interval,
        remote_swap=cfg.kv_mode == "service-remote-swap",
        peer=reachability.KV_SERVICE,  # our CLI's flags in the advice
    )
    if saved.session_id:
        try:
            return await KVClient.connect(
                cfg.service_target, resume_session_id=saved.session_id, **kwargs
            )
        except errors.UnknownRequest as e:
            # Queued requests had no KV there: they are queued again all the same.
            queued = {rid: r for rid, r in saved.requests.items() if r.queued}
            log.warning(
                "saved session %s is gone (%s): its %d admitted requests cannot be resumed",
                saved.session_id,
                e,
                len(saved.requests) - len(queued),
            )
            saved.requests = queued
    return await KVClient.connect(cfg.service_target, **kwargs)


def baseline_control(
    layout: KVLayout, device: str, engine_name: str = "engine", model_fingerprint: str = ""
) -> BaselineControl:
    """The baseline's bookkeeping: a service core over the page table of its own cache, which
    holds max_requests x pages-per-request pages (whatever layout.num_pages says)."""
    from kv_service.core import ServiceCore

    pages = layout.max_requests * layout.max_pages_per_request
    pages_layout = dataclasses.replace(layout, num_pages=pages)
    core = ServiceCore(BaselinePages(pages_layout, device), lease_seconds=EMBEDDED_LEASE_SECONDS)
    return BaselineControl(core, engine_name, model_fingerprint)


def local_control(cfg: EngineConfig, mcfg: ModelConfig, device: str) -> KVControl:
    """Baseline: the engine's own cache; embedded: a service core on local tensors (both hold
    the MTP layer's KV as their last layer with --speculative mtp)."""
    layout = cfg.local.layout(mcfg.kv_layers, mcfg.topk)
    if cfg.kv_mode == "baseline":
        return baseline_control(layout, device, cfg.engine_name, fingerprint(cfg, mcfg))
    from kv_service.core import ServiceCore
    from kv_service.memory.store import allocate_local

    core = ServiceCore(allocate_local(layout, device), lease_seconds=EMBEDDED_LEASE_SECONDS)
    return EmbeddedControl(core, cfg.engine_name, fingerprint(cfg, mcfg))


def _compute_thread(device: str) -> ThreadPoolExecutor:
    # Triton launches on the thread's current CUDA device: pin the compute thread to ours.
    # "cuda" (--device cuda/auto) has no index: it means the current device, 0.
    init = (
        (lambda: torch.cuda.set_device(torch.device(device).index or 0))
        if device.startswith("cuda")
        else None
    )
    return ThreadPoolExecutor(1, thread_name_prefix="engine-compute", initializer=init)


def _build_compute(cfg: EngineConfig, mcfg: ModelConfig, control: KVControl, device: str):
    spec = cfg.spec_tokens
    # The all-on-GPU baseline has no hot buffers for the verify rows to share.
    check_model_fits(mcfg, control.layout, spec if cfg.kv_mode != "baseline" else 0)
    kernels = choose_kernels(cfg.kernels, device.split(":")[0])
    weights = (
        load_safetensors(cfg.checkpoint, mcfg, device)
        if cfg.checkpoint
        else random_weights(mcfg, cfg.weight_seed, device)
    )
    swap_fn = exchange = None
    if isinstance(control, KVClient) and cfg.kv_mode == "service-remote-swap":
        swap_fn, exchange = (
            (lambda layer, bs, rows: control.remote_swap(layer, bs, rows)),
            control.exchange,
        )
    max_batch = min(cfg.max_batch, control.layout.max_requests)
    page_table = control.page_table if isinstance(control, BaselineControl) else None
    backend = build_backend(
        cfg.kv_mode,
        control.layout,
        control.tensors,
        kernels,
        max_batch,
        device,
        swap_fn,
        exchange,
        cfg.decode_microbatches,
        page_table,
        rows_per_request=spec + 1,
    )
    source = load_topk_source(cfg.topk_source, mcfg, control.layout, device)
    drafts = (
        load_draft_source(cfg.draft_source, mcfg, control.layout, device, spec) if spec else None
    )
    return build_compute(
        mcfg,
        weights,
        backend,
        control.layout,
        max_batch,
        cfg.prefill_chunk,
        use_graphs=cfg.cuda_graphs,
        topk_source=source,
        synthetic_context=cfg.synthetic_context,
        synthetic_shared=cfg.synthetic_shared,
        draft_tokens=spec,
        draft_source=drafts,
    )


def _resumed(
    held: HeldRequest,
    saved: state_file.SavedRequest,
    vocab: vocabulary.Vocabulary | None,
    extra: int = 0,
) -> GenRequest | None:
    """extra: what our admissions reserve beyond max_new_tokens (speculative steps)."""
    if held.prompt_len != len(saved.prompt) or held.max_new_tokens != saved.max_new_tokens + extra:
        log.warning("request %s: service and state file disagree, not resumed", held.request_id)
        return None
    req = GenRequest(
        held.request_id,
        saved.prompt,
        saved.max_new_tokens,
        saved.sampling,
        slot=held.slot,
        cached_tokens=held.cached_tokens,
    )
    if saved.text:  # replaying the tokens rebuilds the text and finds stop strings again
        assert vocab is not None  # a request with text was made by an engine with a vocabulary
        req.text = TextStream(vocab, saved.sampling.stop_strings)
    now = req.started
    for tok in saved.tokens:
        reason = req.add_token(tok, now)
        if reason is not None:
            req.end(reason)
            return req
    # Without a token the prefill may be partial: run it again (it rewrites the same rows),
    # after the cached prefix, whose pages are shared and never written. A revived request
    # killed before its re-prefill ended (no token since) redoes it too.
    req.phase = Phase.RUNNING if len(req.tokens) > saved.replayed else Phase.PREFILL
    req.replayed = len(req.tokens) if req.phase is Phase.PREFILL else 0
    req.prefilled = held.cached_tokens
    return req


def _committed(req: GenRequest) -> int:
    """Positions whose KV rows the previous engine wrote for good: those of the steps whose tokens
    it recorded. Its steps launched past them are re-run, and rewrite the same rows."""
    return req.prefilled if req.phase is Phase.PREFILL else req.prompt_len + len(req.tokens) - 1


def _requeued(saved: state_file.SavedRequest, vocab: vocabulary.Vocabulary | None) -> GenRequest:
    req = GenRequest(
        saved.request_id,
        saved.prompt,
        saved.max_new_tokens,
        saved.sampling,
        cache_salt=saved.cache_salt,
    )
    if saved.text:
        assert vocab is not None  # a request with text was made by an engine with a vocabulary
        req.text = TextStream(vocab, saved.sampling.stop_strings)
    return req


async def restore(engine: Engine, control: KVControl, saved: state_file.SavedState) -> None:
    """Adopt the held requests the state file saw admitted, trusting none of their hot buffer's
    residency (contract/residency.py says why), and release the others; queue again the requests
    the file saw queued (one the service holds was admitted, but its start record was lost with
    the process: it sent no token, and runs from the start)."""
    await _adopt_held(engine, control, saved)
    for s in saved.requests.values():
        if s.queued:
            engine.requeue(_requeued(s, engine.vocab))
            log.info("queued request %s again", s.request_id)


async def _adopt_held(engine: Engine, control: KVControl, saved: state_file.SavedState) -> None:
    for held in control.held:
        s = saved.requests.get(held.request_id)
        req = (
            None
            if s is None or s.queued
            else _resumed(held, s, engine.vocab, engine.scheduler.reserve_extra)
        )
        if req is None:
            log.info("releasing held request %s: nothing to resume it from", held.request_id)
            await control.release(held.request_id)
            continue
        engine.adopt(req)
        if control.tensors is not None and not req.finished:
            residency.restart(control.tensors, req.slot, _committed(req))
        log.info(
            "resumed request %s in slot %d after %d of %d tokens",
            req.request_id,
            req.slot,
            len(req.tokens),
            req.max_new_tokens,
        )


async def build_engine(cfg: EngineConfig, metrics: EngineMetrics | None = None) -> Engine:
    """Everything the server needs; the engine loop is not started yet."""
    vocab = await asyncio.to_thread(load_vocabulary, cfg)
    if cfg.state_file and not cfg.resumable:
        log.warning(
            "state file %s ignored: kv mode %s keeps no KV across a restart",
            cfg.state_file,
            cfg.kv_mode,
        )
    # The state file path when resumable (which implies one), as a str | None mypy narrows.
    state_path = cfg.state_file if cfg.resumable else None
    saved = state_file.load(state_path) if state_path is not None else state_file.SavedState()
    if cfg.uses_service:
        # The fingerprint is named at Attach, before the layout is adopted: it names the
        # preset's shapes as configured (every engine of one service adopts the same layers
        # and top-k, so equal fingerprints still mean one model there).
        named = fingerprint(cfg, model_config(cfg, vocab))
        client = await connect_service(cfg, saved, named)
        device = client.device
        # An attached client (what connect returns) has its layout: KVControl's `layout` is
        # never None then, which KVClient's own `KVLayout | None` attribute cannot say.
        control = cast(KVControl, client)
        try:
            if cfg.device != "auto" and cfg.device != device.split(":")[0]:
                raise errors.LayoutMismatch(f"engine device {cfg.device} but service on {device}")
            mcfg = model_config(cfg, vocab, control.layout)
        except BaseException:
            await control.close()
            raise
    else:
        device = cfg.resolved_device()
        mcfg = model_config(cfg, vocab)
        control = local_control(cfg, mcfg, device)
    executor = _compute_thread(device)
    try:
        loop = asyncio.get_running_loop()
        compute = await loop.run_in_executor(executor, _build_compute, cfg, mcfg, control, device)
    except BaseException:
        executor.shutdown()
        await control.close()
        raise
    state = state_file.StateFile(state_path) if state_path is not None else None
    policy = QueueLimits(
        order=queue_policy(cfg.queue_policy, cfg.skip_ahead),
        max_queue_wait=cfg.max_queue_wait,
        admit_retry=cfg.admit_retry,
    )
    engine = Engine(
        compute,
        control,
        executor=executor,
        max_active=cfg.max_batch,
        state=state,
        policy=policy,
        overlap=cfg.overlap and not cfg.spec_tokens,
        vocab=vocab,
        prefix_cache=cfg.prefix_cache,
        share_generated=cfg.prefix_share_generated,
        metrics=metrics,
    )
    engine.metrics.describe(device=device, kv_mode=cfg.kv_mode)
    if cfg.overlap and cfg.spec_tokens:
        log.info("speculative steps are not overlapped: a step's positions need the last one's")
    await restore(engine, control, saved)
    if state is not None:
        admitted = [r for r in engine.requests.values() if r.slot >= 0]
        epoch = getattr(control, "epoch", 0)
        state.rewrite(control.session_id, epoch, admitted, list(engine.waiting))
    return engine

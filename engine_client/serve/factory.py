"""Assemble an engine from its config: the KV control of the mode, weights, backend, compute,
and (service modes with a state file) the requests of the previous engine process, which
engine_client.serve.restore takes back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, cast

from contract import errors
from contract.layout import KVLayout
from engine_client.client import reachability
from engine_client.client.control import KVControl
from engine_client.client.kv_client import KVClient
from engine_client.client.local_control import BaselineControl, BaselinePages, EmbeddedControl
from engine_client.client.prefill_peer import PrefillPeer
from engine_client.client.prefill_router import PrefillRouter
from engine_client.kv.baseline import BaselineBackend
from engine_client.kv.export_control import ExportControl
from engine_client.kv.row_export import RowExport
from engine_client.loop import state_file
from engine_client.loop.admission_limit import AdmissionLimit
from engine_client.loop.admission_setting import admission_limit
from engine_client.loop.engine import Engine
from engine_client.loop.metrics import EngineMetrics
from engine_client.loop.queue_policy import QueueLimits, queue_policy
from engine_client.model.compute import Compute
from engine_client.model.preset import TOKENIZERS, ModelConfig, preset
from engine_client.model.weights import (
    checkpoint_layers,
    model_fingerprint,
)
from engine_client.serve.assembly import build_mode_compute, compute_thread
from engine_client.serve.config import EngineConfig
from engine_client.serve.restore import restore
from engine_client.serve.settings.disaggregation import Disaggregation
from engine_client.serve.settings.queueing import Queueing
from engine_client.text import vocabulary

log = logging.getLogger(__name__)

# How long an embedded core keeps a session without a stream; the engine is its only user.
EMBEDDED_LEASE_SECONDS = 30.0
# Seconds a prefill peer may take for one prompt (compute and transfer).
PREFILL_TIMEOUT = 300.0


def load_vocabulary(cfg: EngineConfig) -> vocabulary.Vocabulary:
    """--tokenizer, else the preset's."""
    return vocabulary.load(cfg.model.tokenizer or TOKENIZERS[cfg.model.preset])


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
    mtp, model = (1 if cfg.speculation.spec_tokens else 0), cfg.model
    overrides: dict = {"vocab_size": vocab.model_vocab_size, "mtp_layers": mtp}
    if model.num_layers:
        overrides["num_layers"] = model.num_layers
    mcfg = preset(model.preset, **overrides)
    if layout is None:
        return mcfg
    if mtp and layout.num_layers != mcfg.kv_layers:
        raise errors.LayoutMismatch(
            f"--speculative mtp needs a KV layout of the model's {mcfg.num_layers} decoder "
            f"layers + 1 MTP layer = {mcfg.kv_layers} layers, the KV service's has "
            f"{layout.num_layers} (start it with --num-layers {mcfg.kv_layers})"
        )
    if model.num_layers is not None and model.num_layers != layout.num_layers - mtp:
        raise errors.LayoutMismatch(
            f"the engine was started with --num-layers {model.num_layers} but the KV service's "
            f"layout has {layout.num_layers} layers (leave --num-layers out to adopt it)"
        )
    if model.checkpoint and (held := checkpoint_layers(model.checkpoint)) < layout.num_layers:
        raise errors.LayoutMismatch(
            f"the checkpoint {model.checkpoint} holds {held} layers but the KV service's layout "
            f"has {layout.num_layers} layers"
        )
    return mcfg.replace(num_layers=layout.num_layers - mtp, topk=layout.topk)


def fingerprint(cfg: EngineConfig, mcfg: ModelConfig) -> str:
    """The model fingerprint given at attach: the prefix cache's namespace ("" turns it off)."""
    if not cfg.prefix.prefix_cache:
        return ""
    return cfg.prefix.model_fingerprint or model_fingerprint(
        mcfg, cfg.model.checkpoint, cfg.model.weight_seed
    )


async def connect_service(
    cfg: EngineConfig, saved: state_file.SavedState, model_fingerprint: str = ""
) -> KVClient:
    """Attach to the service, resuming the saved session if the service still has it."""
    kv = cfg.kv
    kwargs: dict[str, Any] = dict(
        model_fingerprint=model_fingerprint,
        engine_name=kv.engine_name,
        token=kv.token,
        rpc_timeout=kv.rpc_timeout,
        attach_timeout=kv.attach_timeout,
        heartbeat_interval=kv.heartbeat_interval,
        remote_swap=kv.kv_mode == "service-remote-swap",
        peer=reachability.KV_SERVICE,  # our CLI's flags in the advice
    )
    if saved.session_id:
        try:
            return await KVClient.connect(
                kv.service_target, resume_session_id=saved.session_id, **kwargs
            )
        except errors.UnknownRequest as e:
            # Queued and lost requests had no KV there: they come back all the same.
            kept = {rid: r for rid, r in saved.requests.items() if r.queued or r.lost}
            log.warning(
                "saved session %s is gone (%s): its %d admitted requests cannot be resumed",
                saved.session_id,
                e,
                len(saved.requests) - len(kept),
            )
            saved.requests = kept
    return await KVClient.connect(kv.service_target, **kwargs)


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
    if cfg.kv.kv_mode == "baseline":
        return baseline_control(layout, device, cfg.kv.engine_name, fingerprint(cfg, mcfg))
    from kv_service.core import ServiceCore
    from kv_service.memory.store import allocate_local

    kv = allocate_local(layout, device)
    core = ServiceCore(kv, lease_seconds=EMBEDDED_LEASE_SECONDS)
    return EmbeddedControl(core, cfg.kv.engine_name, fingerprint(cfg, mcfg))


async def _control(
    cfg: EngineConfig, vocab: vocabulary.Vocabulary, saved: state_file.SavedState
) -> tuple[KVControl, str, ModelConfig]:
    """The KV control of the mode, the device the engine runs on and the model it runs: a
    service's layout decides the model's shapes, a local control is made for them."""
    if not cfg.kv.uses_service:
        device = cfg.execution.resolved_device()
        mcfg = model_config(cfg, vocab)
        local = local_control(cfg, mcfg, device)
        if cfg.disaggregation.role == "prefill":  # its rows go to a decode side at release
            local = cast(KVControl, ExportControl(local))
        return local, device, mcfg
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
        wanted = cfg.execution.device
        if wanted != "auto" and wanted != device.split(":")[0]:
            raise errors.LayoutMismatch(f"engine device {wanted} but service on {device}")
        return control, device, model_config(cfg, vocab, control.layout)
    except BaseException:
        await control.close()
        raise


def _state_path(cfg: EngineConfig) -> str | None:
    """The state file path when resumable (which implies one), as a str | None mypy narrows."""
    if cfg.kv.state_file and not cfg.kv.resumable:
        log.warning(
            "state file %s ignored: kv mode %s keeps no KV across a restart",
            cfg.kv.state_file,
            cfg.kv.kv_mode,
        )
    return cfg.kv.state_file if cfg.kv.resumable else None


def _queue_limits(queueing: Queueing) -> QueueLimits:
    return QueueLimits(
        order=queue_policy(queueing.queue_policy, queueing.skip_ahead),
        max_queue_wait=queueing.max_queue_wait,
        admit_retry=queueing.admit_retry,
    )


def _admission(cfg: EngineConfig, compute: Compute) -> AdmissionLimit:
    """--admission-limit under --max-batch, over the decode graphs' batch sizes."""
    hisparse = cfg.kv.kv_mode != "baseline"
    buckets = compute.model_runner.cfg.buckets
    return admission_limit(cfg.queueing.admission_limit, cfg.batching.max_batch, hisparse, buckets)


def _export_rows(cfg: EngineConfig, control: KVControl, compute: Compute) -> None:
    """--role prefill: its control writes each released prompt's rows through a NIXL agent."""
    if isinstance(control, ExportControl):
        backend = cast(BaselineBackend, compute.backend)
        d = cfg.disaggregation
        control.export = RowExport(backend, d.transfer_source, d.transfer_peer_idle)


def _prefill_peers(disaggregation: Disaggregation) -> PrefillRouter | None:
    """--role decode: the prefill engines its requests' prompts go to."""
    if disaggregation.role != "decode":
        return None
    return PrefillRouter([PrefillPeer(t, PREFILL_TIMEOUT) for t in disaggregation.prefill_peer])


async def build_engine(cfg: EngineConfig, metrics: EngineMetrics | None = None) -> Engine:
    """Everything the server needs; the engine loop is not started yet."""
    vocab = await asyncio.to_thread(load_vocabulary, cfg)
    state_path = _state_path(cfg)
    saved = state_file.load(state_path) if state_path is not None else state_file.SavedState()
    control, device, mcfg = await _control(cfg, vocab, saved)
    executor = compute_thread(device)
    try:
        run = asyncio.get_running_loop().run_in_executor
        compute = await run(executor, build_mode_compute, cfg, mcfg, control, device)
    except BaseException:
        executor.shutdown()
        await control.close()
        raise
    _export_rows(cfg, control, compute)
    state = state_file.StateFile(state_path) if state_path is not None else None
    engine = Engine(
        compute,
        control,
        executor=executor,
        admission=_admission(cfg, compute),
        state=state,
        policy=_queue_limits(cfg.queueing),
        overlap=cfg.batching.overlap,
        vocab=vocab,
        prefix=cfg.prefix.reuse(device, cfg.execution.batch_invariant),
        metrics=metrics,
        acceptance=cfg.speculation.acceptance,
        prefill_peers=_prefill_peers(cfg.disaggregation),
    )
    if isinstance(control, ExportControl):
        control.on_freed = engine.capacity_freed
    engine.metrics.describe(device=device, kv_mode=cfg.kv.kv_mode)
    _log_speculation(cfg)
    await restore(engine, control, saved)
    return engine


def _log_speculation(cfg: EngineConfig) -> None:
    acceptance = cfg.speculation.acceptance
    if acceptance is not None:  # at start, in every log: the output is not the model's
        log.warning("%s (--speculative-acceptance)", acceptance.describe())

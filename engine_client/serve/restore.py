"""Resume after an engine restart: the requests of the previous engine process come back.

The state file names the KV session of the previous process. The new engine attaches with that
session id; the service hands back the requests it still holds (within its lease), and every one
the state file also knows continues where it was: its KV is in the service's memory, its tokens
and sampling seed in the file. Requests the service holds but the file does not know are
released; requests the file knows but the service lost cannot be resumed. Requests the file saw
queued are queued again; those it saw lost with a KV service are kept finished and revivable, as
the engine that lost them kept them (engine_client.loop.finished): a resume revives them.
"""

from __future__ import annotations

import logging

from contract import residency
from engine_client.client.control import HeldRequest, KVControl
from engine_client.loop import state_file
from engine_client.loop.engine import Engine
from engine_client.loop.failure import RESUME_ADVICE
from engine_client.loop.request import Finish, GenRequest, Phase
from engine_client.text import vocabulary
from engine_client.text.detokenizer import TextStream

log = logging.getLogger(__name__)


def resumed(
    held: HeldRequest,
    saved: state_file.SavedRequest,
    vocab: vocabulary.Vocabulary | None,
    extra: int = 0,
) -> GenRequest | None:
    """extra: what our admissions reserve beyond max_new_tokens (speculative steps)."""
    if held.prompt_len != len(saved.prompt) or held.max_new_tokens != saved.max_new_tokens + extra:
        log.warning("request %s: service and state file disagree, not resumed", held.request_id)
        return None
    # Replaying the tokens rebuilds the text and finds stop strings again.
    req = _request_of(saved, vocab, slot=held.slot, cached_tokens=held.cached_tokens)
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


def _request_of(
    saved: state_file.SavedRequest,
    vocab: vocabulary.Vocabulary | None,
    slot: int = -1,
    cached_tokens: int = 0,
) -> GenRequest:
    """The request as the state file saved it (its salt included, so a resumed request's pages
    keep their tenant's namespace); slot and cached tokens: where the service holds it."""
    req = GenRequest(
        saved.request_id,
        saved.prompt,
        saved.max_new_tokens,
        saved.sampling,
        slot=slot,
        cached_tokens=cached_tokens,
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
    the process: it sent no token, and runs from the start), keep those it saw lost; then start
    the file over with what came back."""
    _empty_region(control)
    await _adopt_held(engine, control, saved)
    for s in saved.requests.values():
        if s.lost:
            engine.api.keep_lost(_lost(s, engine.vocab))
            log.info("kept lost request %s after %d tokens", s.request_id, len(s.tokens))
        elif s.queued:
            engine.api.requeue(_requeued(s, engine.vocab))
            log.info("queued request %s again after %d tokens", s.request_id, len(s.tokens))
    if engine.state is not None:
        admitted = [r for r in engine.requests.values() if r.slot >= 0]
        lost = engine.finished.lost()
        epoch = getattr(control, "epoch", 0)
        engine.state.rewrite(control.session_id, epoch, admitted, list(engine.waiting), lost)


def _requeued(saved: state_file.SavedRequest, vocab: vocabulary.Vocabulary | None) -> GenRequest:
    """A request the file saw queued; one revived after a KV loss has tokens, which its prefill
    stores again before it decodes on (as GenRequest.revive sets it up)."""
    req = _request_of(saved, vocab)
    for tok in saved.tokens:
        req.add_token(tok, req.started)  # rebuilds their text, as a resumed request's
    req.replayed = len(req.tokens)
    return req


def _lost(saved: state_file.SavedRequest, vocab: vocabulary.Vocabulary | None) -> GenRequest:
    """A request the file saw lost with its KV service: failed, as the engine that lost it
    left it, until a resume revives it."""
    req = _requeued(saved, vocab)
    req.lost_kv = True
    req.end(Finish.ERROR, f"its KV service was lost; {RESUME_ADVICE}")
    return req


def _empty_region(control: KVControl) -> None:
    """The shared hot region this engine plans with (its own, or the service's while its
    session holds it) starts empty: the engine this one replaces may have died between a plan
    that keyed a region slot and the copy that was to fill it (kv_service/memory/
    region_lease.py). No step of this engine runs yet, so nothing races the writes."""
    region = control.tensors.shared if control.tensors is not None else None
    if region is not None:
        region.empty()


async def _adopt_held(engine: Engine, control: KVControl, saved: state_file.SavedState) -> None:
    for held in control.held:
        s = saved.requests.get(held.request_id)
        req = (
            None
            if s is None or s.queued or s.lost
            else resumed(held, s, engine.vocab, engine.scheduler.reserve_extra)
        )
        if req is None:
            log.info("releasing held request %s: nothing to resume it from", held.request_id)
            await control.release(held.request_id)
            continue
        engine.api.adopt(req)
        if control.tensors is not None and not req.finished:
            residency.restart(control.tensors, req.slot, _committed(req))
        log.info(
            "resumed request %s in slot %d after %d of %d tokens",
            req.request_id,
            req.slot,
            len(req.tokens),
            req.max_new_tokens,
        )

"""A decode engine's prefill by a peer (`serve --role decode`, prefill/decode disaggregation).

An admitted request (phase REMOTE) is not prefilled here: its prompt goes to a prefill engine
(`client/prefill_router.py` picks it) with the KV service's transfer target and the request's
pages; the peer writes the rows and index keys straight into them over NIXL and answers with
the first token. The service then records the rows as stored and loads the hot buffer (Session
Prefilled), and the request decodes from there as if it had prefilled itself: its first decode
step appends the first token at position prompt_len.

Prefilled here instead (phase PREFILL, the engine's own chunks):
- a prompt whose cached prefix (prefix sharing) is at least LOCAL_SHARE of it;
- a prompt no peer took: every peer down, or the one that had it failed and no other is in.
  A failed peer may have written part of the pages: they are the request's own (private past
  the cached prefix, nothing committed: Prefilled was not sent), and the next prefill, a
  peer's or ours, writes every one of them again before anything reads them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from contract.errors import CapacityError, KVError
from engine_client.client.control import Admission
from engine_client.client.prefill_peer import Prefilled
from engine_client.client.prefill_router import PrefillRouter
from engine_client.loop.control_ref import ControlRef
from engine_client.loop.request import Finish, GenRequest, Phase

log = logging.getLogger(__name__)

# A cached prefix of at least this share of the prompt is prefilled here: a peer has none of our
# cache and would compute the whole prompt and send all of it, while here only the rest is
# computed and nothing is sent. Below it the peer computes the whole prompt and writes only the
# pages past the prefix (the prefix's pages are shared with other requests).
LOCAL_SHARE = 0.5


class RemotePrefill:
    """The prefill peers and the requests they are prefilling."""

    def __init__(
        self,
        router: PrefillRouter,
        control: ControlRef,
        finish: Callable[..., None],
        wake: asyncio.Event,
    ) -> None:
        self.router, self.control = router, control
        self._finish, self._wake = finish, wake
        self._target: Any = None  # the service's TransferTargetResponse, asked once
        self.busy: dict[str, asyncio.Task] = {}

    def start(self, req: GenRequest, adm: Admission) -> None:
        """Send an admitted request to a peer, or leave it to prefill here (phase PREFILL)."""
        if req.cached_tokens and req.cached_tokens >= LOCAL_SHARE * req.prompt_len:
            log.info(
                "request %s prefilled here: %d of its %d prompt tokens are cached",
                *(req.request_id, req.cached_tokens, req.prompt_len),
            )
            return
        req.phase = Phase.REMOTE
        task = asyncio.get_running_loop().create_task(self._run(req, adm))
        self.busy[req.request_id] = task
        task.add_done_callback(lambda _: self.busy.pop(req.request_id, None))

    def pending(self, req: GenRequest) -> bool:
        """A peer may still write the request's pages: they are not to be released yet."""
        return req.request_id in self.busy

    async def _run(self, req: GenRequest, adm: Admission) -> None:
        try:
            done = await self._remote(req, adm)
        except KVError as e:
            self._finish(req, Finish.ERROR, f"remote prefill failed: {e}")
            return
        finally:
            self._wake.set()
        if req.finished:  # cancelled meanwhile: nothing to land
            return
        if done is None:
            self._here(req)
        else:
            self._land(req, done)

    async def _remote(self, req: GenRequest, adm: Admission) -> Prefilled | None:
        """What the first peer that prefilled the prompt (landed) answered; None when no peer
        did. A peer down or full is passed over (the router's rule); any other
        refusal is the request's error."""
        kv = self.control.current
        if self._target is None:
            self._target = await kv.transfer_target()  # type: ignore[attr-defined]
        down: list[Any] = []  # peers that failed this prompt: not asked again for it
        while not req.finished:
            peer = self.router.pick(down)
            if peer is None:
                wait = self.router.until_free(down)
                if wait is None:
                    return None  # every peer down: prefill here
                await asyncio.sleep(wait)
                continue
            try:
                done = await self._ask(peer, req, adm)
            except KVError as e:
                if not self.router.failed(peer, e):
                    raise e.prefixed(f"prefill peer {peer.target}") from e
                if not isinstance(e, CapacityError):
                    down.append(peer)
                continue
            self.router.served(peer)
            if req.finished:
                return None
            await kv.prefilled(req.request_id, req.prompt_len)  # type: ignore[attr-defined]
            log.info(
                "request %s prefilled by %s (%d bytes in %.6f s)",
                *(req.request_id, peer.target, done.bytes_written, done.transfer_seconds),
            )
            return done
        return None

    async def _ask(self, peer: Any, req: GenRequest, adm: Admission) -> Prefilled:
        log.info("request %s sent to prefill peer %s", req.request_id, peer.target)
        sampling = (req.sampling.temperature, req.sampling.seed)
        return await peer.prefill(
            req.request_id, req.prompt, sampling, self._target, adm.pages, req.cached_tokens
        )

    def _here(self, req: GenRequest) -> None:
        """No peer took the prompt: this engine prefills it from its cached prefix on, over
        whatever a failed peer wrote."""
        log.warning(
            "request %s prefilled here: no prefill peer took it (left out: %s)",
            req.request_id,
            ", ".join(self.router.left_out()) or "none",
        )
        req.phase, req.prefilled = Phase.PREFILL, req.cached_tokens

    def _land(self, req: GenRequest, done: Prefilled) -> None:
        """The request runs from here as if its own last prefill chunk had sampled the token
        (and, speculative, drafted after it: the peer's drafts, written into the slot before
        the first verify step, step_runner; empty ones are written as -1, never accepted)."""
        req.prefilled, req.phase, req.launched = req.prompt_len, Phase.RUNNING, 1
        req.peer_drafts = done.drafts
        reason = req.add_token(int(done.first_token), time.monotonic())
        if reason is not None:
            self._finish(req, reason)

    async def close(self) -> None:
        for task in list(self.busy.values()):
            task.cancel()
        await asyncio.gather(*self.busy.values(), return_exceptions=True)
        await self.router.close()

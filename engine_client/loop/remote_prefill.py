"""A decode engine's prefill by a peer (`serve --role decode`, prefill/decode disaggregation).

An admitted request (phase REMOTE) is not prefilled here: its prompt goes to the prefill engine
with the KV service's transfer target and the request's pages; the peer writes the rows and
index keys straight into them over NIXL and answers with the first token. The service then
records the rows as stored and loads the hot buffer (Session Prefilled), and the request
decodes from there as if it had prefilled itself: its first decode step appends the first
token at position prompt_len.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from contract.errors import KVError
from engine_client.client.control import Admission
from engine_client.client.prefill_peer import PrefillPeer
from engine_client.loop.control_ref import ControlRef
from engine_client.loop.request import Finish, GenRequest, Phase

log = logging.getLogger(__name__)


class RemotePrefill:
    """The prefill peer and the requests it is prefilling."""

    def __init__(
        self,
        peer: PrefillPeer,
        control: ControlRef,
        finish: Callable[..., None],
        wake: asyncio.Event,
    ) -> None:
        self.peer, self.control = peer, control
        self._finish, self._wake = finish, wake
        self._target: Any = None  # the service's TransferTargetResponse, asked once
        self.busy: dict[str, asyncio.Task] = {}

    def start(self, req: GenRequest, adm: Admission) -> None:
        req.phase = Phase.REMOTE
        task = asyncio.get_running_loop().create_task(self._run(req, adm))
        self.busy[req.request_id] = task
        task.add_done_callback(lambda _: self.busy.pop(req.request_id, None))

    def pending(self, req: GenRequest) -> bool:
        """The peer may still write the request's pages: they are not to be released yet."""
        return req.request_id in self.busy

    async def _run(self, req: GenRequest, adm: Admission) -> None:
        try:
            kv = self.control.current
            if self._target is None:
                self._target = await kv.transfer_target()  # type: ignore[attr-defined]
            sampling = (req.sampling.temperature, req.sampling.seed)
            done = await self.peer.prefill(
                req.request_id, req.prompt, sampling, self._target, adm.pages
            )
            if req.finished:  # cancelled meanwhile: nothing to land
                return
            await kv.prefilled(req.request_id, req.prompt_len)  # type: ignore[attr-defined]
        except KVError as e:
            self._finish(req, Finish.ERROR, f"remote prefill failed: {e}")
            return
        finally:
            self._wake.set()
        self._land(req, done.first_token)

    def _land(self, req: GenRequest, first_token: int) -> None:
        """The request runs from here as if its own last prefill chunk had sampled the token."""
        if req.finished:
            return
        req.prefilled, req.phase, req.launched = req.prompt_len, Phase.RUNNING, 1
        log.info("request %s prefilled by %s", req.request_id, self.peer.target)
        reason = req.add_token(first_token, time.monotonic())
        if reason is not None:
            self._finish(req, reason)

    async def close(self) -> None:
        for task in list(self.busy.values()):
            task.cancel()
        await asyncio.gather(*self.busy.values(), return_exceptions=True)
        await self.peer.close()

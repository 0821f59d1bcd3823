"""A decode engine's client of a prefill engine (prefill.v1.PrefillService): one call per
request, carrying the prompt, the decode service's transfer target and the request's pages;
failures become the typed errors of `contract.errors` (`client.status`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from engine_client.client import address
from engine_client.client.status import rpc_errors
from proto.kvcache.v1 import kvcache_pb2 as kpb
from proto.prefill.v1 import prefill_pb2 as pb
from proto.prefill.v1 import prefill_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Prefilled:
    """What a prefill engine did: the first token, the tokens and bytes it wrote, the
    seconds the write took, and its MTP layer's drafts after the first token (a speculative
    prefill engine; else empty)."""

    first_token: int
    tokens: int
    bytes_written: int
    transfer_seconds: float = 0.0
    drafts: tuple[int, ...] = ()


class PrefillPeer:
    """One prefill engine, over one channel."""

    def __init__(self, target: str, timeout: float) -> None:
        self.target = address.grpc_target(target)
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(self.target)
        self._stub = pb_grpc.PrefillServiceStub(self._channel)

    async def prefill(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: tuple[float, int],
        where: kpb.TransferTargetResponse,
        pages: Sequence[int],
        cached_tokens: int = 0,
    ) -> Prefilled:
        """Have the peer compute `prompt` and write its KV into `pages` of `where`, but for the
        first `cached_tokens` (a cached prefix: shared pages); sampling: (temperature, seed) of
        the first token."""
        msg = pb.PrefillRequest(
            request_id=request_id,
            prompt=prompt,
            temperature=sampling[0],
            seed=sampling[1],
            target=where,
            pages=pages,
            cached_tokens=cached_tokens,
        )
        # Fail fast (no wait_for_ready): a peer that is down is passed over by the router at
        # once instead of holding the prompt until the deadline.
        with rpc_errors("Prefill"):
            r = await self._stub.Prefill(msg, timeout=self.timeout)
        return Prefilled(
            r.first_token, r.prefilled_tokens, r.bytes_written, r.transfer_seconds, tuple(r.drafts)
        )

    async def close(self) -> None:
        await self._channel.close()

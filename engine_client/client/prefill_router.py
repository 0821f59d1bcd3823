"""Which prefill engine a decode engine's next prompt goes to (`--prefill-peer A,B,...`).

Round-robin over the configured peers, skipping a peer that is left out for now:
- down (unreachable, the call failed or timed out: `ServiceUnavailable`): left out for a
  backoff that starts at DOWN_BACKOFF[0] seconds and doubles per failure in a row up to
  DOWN_BACKOFF[1], then tried again by the next prompt that reaches it;
- full (it refused with a `CapacityError`: its batch is taken): left out for FULL_BACKOFF, a
  moment, since a prompt leaves a prefill engine within a few steps.
A peer that answers is back in at once. With every peer left out, `pick` gives None: a prompt
waits for a full peer (`until_free`: backpressure, the decode engine keeps decoding), and with
every peer down the decode engine prefills it itself (`loop/remote_prefill.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from contract.errors import CapacityError, KVError, ServiceUnavailable

log = logging.getLogger(__name__)

# Seconds a peer that failed is left out: after its first failure in a row, and at most.
DOWN_BACKOFF = (1.0, 60.0)
# Seconds a peer that said it is full is left out.
FULL_BACKOFF = 0.5


class Peer(Protocol):
    """A prefill engine as the router sees it (`client.prefill_peer.PrefillPeer`)."""

    target: str

    async def prefill(self, *args: Any, **kwargs: Any) -> Any: ...

    async def close(self) -> None: ...


@dataclass
class _Standing:
    out_until: float = 0.0  # left out before this clock reading
    failures: int = 0  # failed calls in a row
    full: bool = False  # left out because it was full (not down)


class PrefillRouter:
    """The peers, the next one's turn, and which are left out until when."""

    def __init__(self, peers: Sequence[Peer], clock: Callable[[], float] = time.monotonic):
        if not peers:
            raise ValueError("a prefill router needs at least one peer")
        self.peers = tuple(peers)
        self.clock = clock
        self._turn = 0
        self._standing = [_Standing() for _ in self.peers]

    def pick(self, tried: Sequence[Peer] = ()) -> Peer | None:
        """The next peer in turn that is neither left out nor in `tried` (this prompt's
        earlier attempts); None when there is none."""
        now, n = self.clock(), len(self.peers)
        for k in range(n):
            i = (self._turn + k) % n
            peer = self.peers[i]
            if any(peer is t for t in tried) or self._standing[i].out_until > now:
                continue
            self._turn = (i + 1) % n
            return peer
        return None

    def served(self, peer: Peer) -> None:
        """The peer answered: it is in again, its failures forgotten."""
        self._standing[self._index(peer)] = _Standing()

    def failed(self, peer: Peer, err: KVError) -> bool:
        """Record a failed call; True when another peer (or the decode engine) may take the
        prompt: the peer was full or down. Any other error is the prompt's own."""
        s = self._standing[self._index(peer)]
        if isinstance(err, CapacityError):
            s.out_until, s.full = self.clock() + FULL_BACKOFF, True
            log.info("prefill peer %s is full: %s", peer.target, err)
            return True
        if isinstance(err, ServiceUnavailable):
            s.failures, s.full = s.failures + 1, False
            wait = min(DOWN_BACKOFF[0] * 2 ** (s.failures - 1), DOWN_BACKOFF[1])
            s.out_until = self.clock() + wait
            log.warning("prefill peer %s is down (left out %g s): %s", peer.target, wait, err)
            return True
        return False

    def until_free(self, tried: Sequence[Peer] = ()) -> float | None:
        """Seconds until the first full peer not in `tried` is in again; None when no peer is
        left out for being full (every one left out is down: do not wait for it)."""
        now = self.clock()
        waits = [
            max(s.out_until - now, 0.0)
            for p, s in zip(self.peers, self._standing)
            if s.full and not any(p is t for t in tried)
        ]
        return min(waits, default=None)

    def left_out(self) -> list[str]:
        """The targets left out now (logs, tests)."""
        now = self.clock()
        return [p.target for p, s in zip(self.peers, self._standing) if s.out_until > now]

    def _index(self, peer: Peer) -> int:
        for i, p in enumerate(self.peers):
            if p is peer:
                return i
        raise ValueError(f"{peer.target} is not one of this router's peers")

    async def close(self) -> None:
        for peer in self.peers:
            await peer.close()

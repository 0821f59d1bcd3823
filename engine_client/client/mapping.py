"""The KV service's memory mapped into this process: what one attach mapped, whether its owner
still lives, and letting go of it, with the check that every CUDA IPC mapping really closed
(a lost exporter's reference counter files are removed once it is dead)."""

from __future__ import annotations

import logging

from contract import codec, handle, segment_map
from contract.ipc_release import remove_counter_files
from contract.layout import KVLayout
from contract.tensors import KVTensors
from engine_client.client import attachment
from proto.kvcache.v1 import kvcache_pb2 as pb

log = logging.getLogger(__name__)


class Mapping:
    """The segments mapped from one service at `target`; one per client, reused across
    re-attaches (the segment map and the lost exporters' counter files outlive an attach)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.tensors: KVTensors | None = None
        self.exchange: dict = {}
        self._segments = segment_map.SegmentMap()
        self._owner_files: list[dict] = []  # the service's files: alive while they are
        self._handles: list[dict] = []
        self._stale_counters: list[tuple[int, str]] = []  # (exporter pid, counter file)

    @property
    def mapped(self) -> bool:
        return self.tensors is not None

    def map(self, reply: pb.AttachResponse, layout: KVLayout, device: str, swap: bool) -> None:
        self.tensors, self.exchange, self._owner_files = attachment.map_memory(
            reply, layout, device, swap, self._segments
        )
        self._handles = [codec.handle_from_proto(h) for h in reply.tensors]

    def owner_alive(self) -> bool:
        """False once the service that exported the memory is gone (nothing mapped: True)."""
        return not self._owner_files or self._segments.is_owner_alive(self._owner_files)

    def unmap(self) -> list[dict]:
        """Unmap everything; the CUDA IPC handles that were mapped (to check with
        `check_ipc_closed` once their users let go too)."""
        ipc = [h for h in self._handles if h["kind"] == "cuda_ipc"]
        if self.tensors is not None:
            self._segments.unmap(self.tensors)
        self._segments.unmap(self.exchange)
        self._segments.forget_files(self._handles)
        self.tensors, self.exchange, self._owner_files, self._handles = None, {}, [], []
        return ipc

    def check_ipc_closed(self, ipc: list[dict]) -> None:
        """Every CUDA IPC storage mapped from the service must be gone now: its mapping closes
        with the last one. Says which is not, and who holds it; removes the reference counter
        files of a dead exporter (a SIGKILLed service leaves them in /dev/shm)."""
        left = self._segments.ipc.unreleased()
        if left:
            log.error(
                "CUDA IPC memory of the service at %s is still mapped after letting go: %s",
                self.target,
                "; ".join(str(x) for x in left),
            )
        else:
            log.info("closed the %d CUDA IPC mappings of the service at %s", len(ipc), self.target)
        shares = [handle.decode_ipc(h["ipc"]) for h in ipc]
        self._stale_counters += [(pid, share[4].decode(errors="replace")) for pid, share in shares]
        self.remove_stale_counters()

    def remove_stale_counters(self) -> None:
        """Unlink the counter files of lost exporters that are dead by now. One that still runs
        (exiting, or not yet reaped) is tried again at the next re-attach."""
        removed, self._stale_counters = remove_counter_files(self._stale_counters)
        if removed:
            log.info("removed %d CUDA IPC counter files of the dead service", removed)

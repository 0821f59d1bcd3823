"""NixlAgent: this process's NIXL agent (UCX backend), the memory it registered and the peers
it loaded, released together. The one module that imports nixl, and only when an agent is
made: the package is optional (`pip install nixl-cu12`, or nixl-cu13); without it, making an
agent raises TransferUnsupported and nothing else in the project needs it.

The decode service registers its host tier and index-key pool and hands out `target()`; a
prefill engine registers its own cache and `write`s a prompt's spans into the target. Both
sides run UCX: shared memory or TCP on one machine, RDMA or NVLink across machines.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from contract.errors import KVError, ServiceUnavailable, TransferUnsupported
from contract.layout import KVLayout
from contract.transfer_target import Region, Span, TransferTarget

log = logging.getLogger(__name__)

# The import names of the NIXL wheels: the meta package, then the CUDA builds.
NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")
BACKEND = "UCX"
# Seconds a write may take before the peer counts as lost.
WRITE_TIMEOUT = 60.0


def load_nixl() -> Any:
    """The nixl API module, or TransferUnsupported naming what to install."""
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise TransferUnsupported(
        "prefill/decode disaggregation needs NIXL: pip install nixl-cu12 (or nixl-cu13)"
    )


def nixl_available() -> bool:
    """Whether a nixl wheel is installed, without importing it: its native libraries, once
    loaded, crash grpc_tools' protoc compiler loaded later in the same process (seen in the
    test session: proto/generate.py after a skip check that imported nixl)."""
    return any(importlib.util.find_spec(name) is not None for name in NIXL_MODULES)


def region_of(name: str, tensor: torch.Tensor, layer_stride: int, page_stride: int) -> Region:
    """The region a contiguous tensor's bytes make: host memory is NIXL's DRAM, a CUDA
    tensor's is VRAM of its device (what UCX's CUDA transports read from, GPU to remote host)."""
    if not tensor.is_contiguous():
        raise ValueError(f"region {name}: NIXL registers contiguous memory only")
    on_gpu = tensor.device.type == "cuda"
    return Region(
        name=name,
        address=tensor.data_ptr(),
        nbytes=tensor.numel() * tensor.element_size(),
        layer_stride=layer_stride,
        page_stride=page_stride,
        memory_type="VRAM" if on_gpu else "DRAM",
        device_id=(tensor.device.index or 0) if on_gpu else 0,
    )


def transfer_descs(
    src: Region, dst: Region, spans: Sequence[Span]
) -> tuple[np.ndarray, np.ndarray]:
    """NIXL's descriptor lists of a write, (address, bytes, device id) per span: the local
    side's from `src`, the remote side's from `dst`."""
    local = [(src.address + s.src_offset, s.nbytes, src.device_id) for s in spans]
    remote = [(dst.address + s.dst_offset, s.nbytes, dst.device_id) for s in spans]
    return np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64)


class NixlAgent:
    """One agent; `close` deregisters its memory and forgets its peers."""

    def __init__(self, name: str) -> None:
        api = load_nixl()
        config = api.nixl_agent_config(backends=[BACKEND])
        self.name = name
        self._agent = api.nixl_agent(name, config)
        if BACKEND not in self._agent.backends:
            raise TransferUnsupported(f"NIXL has no {BACKEND} backend in this installation")
        self._registered: dict[str, tuple[Any, Region]] = {}
        self._peers: set[str] = set()

    def register(
        self, name: str, tensor: torch.Tensor, layer_stride: int, page_stride: int
    ) -> Region:
        """Register a contiguous tensor's bytes as region `name` with its page geometry."""
        region = region_of(name, tensor, layer_stride, page_stride)
        descs = self._agent.register_memory(
            [(region.address, region.nbytes, region.device_id, "")], region.memory_type
        )
        self._registered[name] = (descs, region)
        return region

    def target(self, layout: KVLayout) -> TransferTarget:
        """What a peer needs to write into this agent's regions."""
        regions = tuple(region for _, region in self._registered.values())
        return TransferTarget(self.name, self._agent.get_agent_metadata(), regions, layout)

    def region(self, name: str) -> Region:
        return self._registered[name][1]

    def write(self, target: TransferTarget, plan: Sequence[tuple[str, Sequence[Span]]]) -> int:
        """`write_timed`'s bytes alone."""
        return self.write_timed(target, plan)[0]

    def write_timed(
        self, target: TransferTarget, plan: Sequence[tuple[str, Sequence[Span]]]
    ) -> tuple[int, dict[str, float]]:
        """Write every (region name, spans) of `plan` from ours into the target's region of the
        same name, all posted at once; returns, once every one is done, the bytes written and
        each region's seconds from posting to completion. Any failure is ServiceUnavailable:
        NIXL raises its own errors (nixlRemoteDisconnectError when the target's process is
        gone), which no caller should have to know."""
        handles: list[Any] = []
        try:
            peer = self._peer(target)
            start = time.monotonic()
            for name, spans in plan:
                handles.append(self._post(peer, self.region(name), target.region(name), spans))
            done = self._wait(handles)
        except KVError:
            raise
        except Exception as e:
            raise ServiceUnavailable(
                f"a NIXL write to {target.agent_name} failed: {e!r}", peer=target.agent_name
            ) from e
        finally:
            for handle in handles:
                self._release(handle)
        seconds = {name: at - start for (name, _), at in zip(plan, done)}
        return sum(s.nbytes for _, spans in plan for s in spans), seconds

    def _peer(self, target: TransferTarget) -> str:
        if target.agent_name not in self._peers:
            loaded = self._agent.add_remote_agent(target.metadata)
            self._peers.add(loaded if isinstance(loaded, str) else loaded.decode())
        return target.agent_name

    def _post(self, peer: str, src: Region, dst: Region, spans: Sequence[Span]) -> Any:
        local, remote = transfer_descs(src, dst, spans)
        handle = self._agent.initialize_xfer(
            "WRITE",
            self._agent.get_xfer_descs(local, src.memory_type),
            self._agent.get_xfer_descs(remote, dst.memory_type),
            peer,
        )
        try:
            posted = self._agent.transfer(handle)
        except BaseException:
            self._release(handle)
            raise
        if posted == "ERR":
            self._release(handle)
            raise ServiceUnavailable(f"NIXL could not post a write to {peer}", peer=peer)
        return handle

    def _release(self, handle: Any) -> None:
        """Release a transfer handle; one of a peer that died may refuse (logged): the
        agent's own teardown frees it then."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:
            log.warning("NIXL transfer handle not released: %r", e)

    def _wait(self, handles: list[Any]) -> list[float]:
        """Poll until every handle is done; when each was first seen done (monotonic)."""
        deadline = time.monotonic() + WRITE_TIMEOUT
        pending, done = list(range(len(handles))), [0.0] * len(handles)
        while pending:
            states = [self._agent.check_xfer_state(handles[i]) for i in pending]
            if "ERR" in states:
                raise ServiceUnavailable("a NIXL write failed: the peer is gone or refused it")
            now = time.monotonic()
            for i, state in zip(pending, states):
                if state == "DONE":
                    done[i] = now
            pending = [i for i, s in zip(pending, states) if s != "DONE"]
            if pending and time.monotonic() > deadline:
                raise ServiceUnavailable(f"a NIXL write took more than {WRITE_TIMEOUT:g} s")
            if pending:
                time.sleep(0.0005)  # UCX progresses on its own thread; don't spin a core
        return done

    def forget(self, agent_name: str) -> None:
        """Drop a peer (its metadata and connection)."""
        if agent_name in self._peers:
            self._peers.discard(agent_name)
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception as e:  # a peer that died may be half torn down already
                log.warning("NIXL peer %s not removed cleanly: %r", agent_name, e)

    @property
    def registered(self) -> int:
        return len(self._registered)

    @property
    def regions(self) -> list[Region]:
        return [region for _, region in self._registered.values()]

    @property
    def peers(self) -> list[str]:
        """The peers loaded now (their metadata and connection held)."""
        return sorted(self._peers)

    def deregister(self, name: str) -> None:
        descs, _ = self._registered.pop(name)
        self._agent.deregister_memory(descs)

    def close(self) -> None:
        """Every registration released and every peer forgotten; idempotent."""
        for peer in list(self._peers):
            self.forget(peer)
        for name in list(self._registered):
            self.deregister(name)
        log.debug("NIXL agent %s closed", self.name)

"""A prefill engine's exports (engine_client.kv.row_export) with a stand-in NIXL agent (no nixl
needed): what is written is counted; an export whose write fails or whose caller goes away
(before or during the write) is dropped and its decode side's agent forgotten unless another
export needs it; an agent left idle is forgotten after `peer_idle`; nothing is held after.
The busy clock counts overlapping writes once. The export control (engine_client.kv.
export_control) returns from a release before its write ends and gives the pages back after."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from contract.errors import LayoutMismatch, ServiceUnavailable
from contract.nixl_agent import region_of
from contract.transfer_target import Region, TransferTarget
from engine_client.client.control import Admission
from engine_client.kv.export_control import ExportControl
from engine_client.kv.row_export import BusyClock, RowExport
from tests.process_harness import layout_with, wait_until

LAYOUT = layout_with(num_layers=2, page_size=4, num_pages=8, max_requests=2, max_context=16)


class _Agent:
    """Registers and writes as contract.nixl_agent.NixlAgent does, in memory; `gate` holds a
    write until set, `fail` makes the next write fail."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self.peers: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def register(self, name: str, tensor: torch.Tensor, layer: int, page: int) -> Region:
        self._regions[name] = region_of(name, tensor, layer, page)
        return self._regions[name]

    def region(self, name: str) -> Region:
        return self._regions[name]

    @property
    def regions(self) -> list[Region]:
        return list(self._regions.values())

    def write_timed(self, target: TransferTarget, plan) -> tuple[int, dict[str, float]]:
        if target.agent_name not in self.peers:
            self.peers.append(target.agent_name)
        self.gate.wait(10)
        if self.fail:
            raise ServiceUnavailable("the peer is gone")
        return sum(s.nbytes for _, spans in plan for s in spans), {n: 0.25 for n, _ in plan}

    def forget(self, name: str) -> None:
        self.peers.remove(name)

    def close(self) -> None:
        self.peers.clear()


def _export(peer_idle: float = 60.0) -> tuple[RowExport, _Agent]:
    L, N, P = LAYOUT.num_layers, 8, LAYOUT.page_size
    backend = SimpleNamespace(
        layout=LAYOUT,
        stored_rows=torch.zeros((L, N * P + 1, LAYOUT.row_bytes), dtype=torch.uint8),
        stored_index=torch.zeros((L, N + 1, P, LAYOUT.index_bytes), dtype=torch.uint8),
    )
    agent = _Agent()
    return RowExport(backend, "direct", peer_idle, agent), agent  # type: ignore[arg-type]


def _target(name: str) -> TransferTarget:
    rows = Region("rows", 0, 1 << 20, layer_stride=1 << 12, page_stride=1 << 14)
    index = Region("index", 0, 1 << 20, layer_stride=1 << 12, page_stride=1 << 14)
    return TransferTarget(name, b"", (rows, index), LAYOUT)


def _idle(export: RowExport) -> bool:
    return export.pending == 0 and export.writes == 0


def test_a_written_export_is_counted_and_its_peer_forgotten_once_idle() -> None:
    asyncio.run(_a_written_export_is_counted_and_its_peer_forgotten_once_idle())


async def _a_written_export_is_counted_and_its_peer_forgotten_once_idle() -> None:
    export, agent = _export(peer_idle=0.01)
    done = export.expect("r1", _target("decode-a"), [3, 5], (0, 6))
    await export.export("r1", [0, 1])
    written = await done
    assert written.nbytes == 2 * (4 + 2) * LAYOUT.row_bytes + 2 * 2 * 4 * LAYOUT.index_bytes
    assert (export.totals.written, export.totals.nbytes) == (1, written.nbytes)
    # Each region's part of the write, summed by region.
    assert written.region_seconds == export.totals.region_seconds == {"rows": 0.25, "index": 0.25}
    assert agent.peers == ["decode-a"]  # kept for the next prompt a while
    await wait_until(lambda: not agent.peers)
    assert _idle(export)


def test_a_failed_write_is_dropped_and_its_peer_forgotten() -> None:
    asyncio.run(_a_failed_write_is_dropped_and_its_peer_forgotten())


async def _a_failed_write_is_dropped_and_its_peer_forgotten() -> None:
    export, agent = _export()
    agent.fail = True
    done = export.expect("r1", _target("decode-a"), [3], (0, 2))
    await export.export("r1", [0])
    with pytest.raises(ServiceUnavailable):
        await done
    assert export.totals.dropped == 1 and not agent.peers and _idle(export)


def test_a_caller_gone_during_the_write_drops_the_export_when_it_ends() -> None:
    asyncio.run(_a_caller_gone_during_the_write_drops_the_export_when_it_ends())


async def _a_caller_gone_during_the_write_drops_the_export_when_it_ends() -> None:
    export, agent = _export()
    agent.gate.clear()
    done = export.expect("r1", _target("decode-a"), [3], (0, 2))
    writing = asyncio.create_task(export.export("r1", [0]))
    await wait_until(lambda: export.writes == 1)
    done.cancel()  # the handler was cancelled: the decode engine is gone
    export.drop("r1", caller_gone=True)  # what the servicer does then: the write goes on
    assert agent.peers == ["decode-a"]
    agent.gate.set()
    await writing
    assert (export.totals.written, export.totals.dropped) == (0, 1)
    assert not agent.peers and _idle(export)


def test_a_caller_gone_before_its_release_leaves_a_busy_peer_loaded() -> None:
    asyncio.run(_a_caller_gone_before_its_release_leaves_a_busy_peer_loaded())


async def _a_caller_gone_before_its_release_leaves_a_busy_peer_loaded() -> None:
    export, agent = _export()
    target = _target("decode-a")
    export.expect("r1", target, [3], (0, 2))
    await export.export("r1", [0])  # the peer is loaded
    export.expect("r2", target, [4], (0, 2))
    export.expect("r3", target, [5], (0, 2))
    export.drop("r2", caller_gone=True)
    assert agent.peers == ["decode-a"]  # r3 still waits for it
    export.drop("r3", caller_gone=True)
    assert not agent.peers and export.totals.dropped == 2 and _idle(export)


def test_the_busy_clock_counts_overlapping_writes_once() -> None:
    now = [0.0]
    clock = BusyClock(clock=lambda: now[0])
    with clock:  # 0 -> 3, a second write 1 -> 5 overlapping it: busy 0 -> 5
        now[0] = 1.0
        clock.__enter__()
        now[0] = 3.0
    now[0] = 5.0
    clock.__exit__()
    assert clock.seconds == 5.0
    now[0] = 7.0
    with clock:  # idle 5 -> 7 not counted; 7 -> 8 is
        now[0] = 8.0
    assert clock.seconds == 6.0
    with pytest.raises(AssertionError):
        clock.__exit__()  # a write that never began


class _Baseline:
    """The wrapped control: admits with fixed pages, records releases."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def admit(self, request_id, prompt_len, max_new_tokens, prefix=None) -> Admission:
        return Admission(request_id, 0, 0, prompt_len + max_new_tokens, pages=(0, 1))

    async def release(self, request_id: str, page_hashes=()) -> None:
        self.released.append(request_id)

    async def close(self, detach: bool = False) -> None:
        pass


def test_a_release_returns_before_its_write_and_frees_the_pages_after() -> None:
    asyncio.run(_a_release_returns_before_its_write_and_frees_the_pages_after())


async def _a_release_returns_before_its_write_and_frees_the_pages_after() -> None:
    inner, freed = _Baseline(), []
    control = ExportControl(inner)  # type: ignore[arg-type]
    control.export, agent = _export()
    control.on_freed = lambda: freed.append(len(inner.released))
    for rid in ("r1", "r2"):
        await control.admit(rid, 6, 1)
    done = control.export.expect("r1", _target("decode-a"), [3, 5], (0, 6))
    agent.gate.clear()  # the write hangs until set
    await control.release("r1")  # returns with the write under way: the loop goes on
    await wait_until(lambda: control.export.writes == 1)
    assert inner.released == [] and control.writes_in_flight == 1 and not done.done()
    await control.release("r2")  # no export waits for it: released at once
    assert inner.released == ["r2"]
    agent.gate.set()
    assert (await done).nbytes > 0
    await wait_until(lambda: control.writes_in_flight == 0)
    assert inner.released == ["r2", "r1"] and freed == [2]  # pages back, then the engine told


def test_closing_waits_for_the_writes_in_flight() -> None:
    asyncio.run(_closing_waits_for_the_writes_in_flight())


async def _closing_waits_for_the_writes_in_flight() -> None:
    inner = _Baseline()
    control = ExportControl(inner)  # type: ignore[arg-type]
    control.export, agent = _export()
    await control.admit("r1", 6, 1)
    control.export.expect("r1", _target("decode-a"), [3, 5], (0, 6))
    agent.gate.clear()
    await control.release("r1")
    asyncio.get_running_loop().call_later(0.05, agent.gate.set)
    await control.close()
    assert inner.released == ["r1"] and control.writes_in_flight == 0


def test_a_target_one_layer_apart_names_the_mtp_layer() -> None:
    """A decode side one layer deeper runs --speculative mtp (the MTP layer's KV is the
    layout's last layer): the refusal says how to match them."""
    export, _ = _export()
    deeper = TransferTarget(
        "d",
        b"",
        _target("d").regions,
        layout_with(**{**LAYOUT.to_dict(), "num_layers": LAYOUT.num_layers + 1}),
    )
    with pytest.raises(
        LayoutMismatch, match="num_layers .2 here, 3 there.; run both with --speculative mtp"
    ):
        export.check(deeper)
    coarser = TransferTarget(
        "c", b"", _target("c").regions, layout_with(**{**LAYOUT.to_dict(), "page_size": 8})
    )
    with pytest.raises(LayoutMismatch) as refused:
        export.check(coarser)
    assert "page_size (4 here, 8 there)" in str(refused.value)
    assert "speculative" not in str(refused.value)
    export.close()

"""Host registration of segment files (contract.file_mapping): once per mapping, one mapping per
file in a process, undone by the last user, and always before the pages are unmapped.

The driver keeps a range registered after its munmap, and the next mapping placed over it fails
to register (cudaError 712): the CPU tests run the bookkeeping against a fake registrar that
answers as the driver does, and checks that a range is still mapped when it is unregistered.
The GPU tests do the same against CUDA."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from contract import file_mapping
from contract.file_mapping import ALREADY_REGISTERED, HostRegisterError
from contract.segment_map import SegmentMap
from kv_service.memory import segment
from tests.kv_service.test_segment import LAYOUT


class DriverLikeRegistrar:
    """Registers ranges as CUDA does: a range that overlaps a registered one is refused (712);
    unregistering an address not registered, or one no longer mapped, is recorded as a fault."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}  # address -> bytes
        self.registrations = 0
        self.faults: list[str] = []

    def register(self, address: int, nbytes: int) -> None:
        if any(a < address + nbytes and address < a + n for a, n in self.ranges.items()):
            raise HostRegisterError(f"cudaError {ALREADY_REGISTERED} at {address:#x}")
        self.ranges[address] = nbytes
        self.registrations += 1

    def unregister(self, address: int) -> None:
        if self.ranges.pop(address, None) is None:
            self.faults.append(f"{address:#x} unregistered but not registered")
        elif not _mapped(address):
            self.faults.append(f"{address:#x} unregistered after its munmap")


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        spans = [line.split()[0].split("-") for line in f]
    return any(int(lo, 16) <= address < int(hi, 16) for lo, hi in spans)


@pytest.fixture
def exported(tmp_path: Path):
    # The exporter's tensors are dropped: the mappers' are then the files' only mappings.
    yield segment.create_segments(LAYOUT, "cpu", str(tmp_path), "reg")[1]
    segment.remove_segments(str(tmp_path), "reg")


def test_a_dropped_mapping_is_unregistered_while_still_mapped(exported: list[dict]) -> None:
    """Tensors dropped without `unmap` (a test's helper going out of scope): the registration
    goes with the mapping, before the pages, so a later mapping placed there registers."""
    fake = DriverLikeRegistrar()
    for _ in range(5):
        kv = SegmentMap(fake).map_segments(LAYOUT, exported, "cpu")
        kv.host_kv.fill_(7)
        del kv
        gc.collect()
        assert fake.ranges == {} and fake.faults == []
    assert fake.registrations == 5 * len(exported)


def test_one_file_mapped_twice_in_a_process_is_registered_once(exported: list[dict]) -> None:
    """A re-attach maps the service's files again while the engine may still hold the old
    tensors; two clients of one process map the same files: one mapping, one registration,
    unregistered when the last of them lets go."""
    fake = DriverLikeRegistrar()
    first, second = SegmentMap(fake), SegmentMap(fake)
    a = first.map_segments(LAYOUT, exported, "cpu")
    again = first.map_segments(LAYOUT, exported, "cpu")  # the re-attach, old tensors alive
    b = second.map_segments(LAYOUT, exported, "cpu")
    assert a.host_kv.data_ptr() == again.host_kv.data_ptr() == b.host_kv.data_ptr()
    assert fake.registrations == len(exported) == len(fake.ranges)
    a.host_kv[0].fill_(3)
    assert (b.host_kv[0] == 3).all()
    first.unmap(a)
    first.unmap(again)
    assert len(fake.ranges) == len(exported), "unregistered under the other client"
    first.unmap(again)  # a second unmap of the same tensors takes nothing more
    assert len(fake.ranges) == len(exported)
    second.unmap(b)
    assert fake.ranges == {} and fake.faults == []
    del a, again, b
    gc.collect()
    assert fake.faults == []


def test_a_file_replaced_under_its_name_gets_its_own_mapping(tmp_path: Path) -> None:
    """Same name, new file (a restarted service): a new mapping, never the old pages."""
    path = tmp_path / "f"
    mappings = []
    for fill in (b"a", b"b"):
        path.unlink(missing_ok=True)
        path.write_bytes(fill * 4096)
        with open(path, "rb+") as f:
            mappings.append(file_mapping.open_file(f.fileno()))
    assert mappings[0].identity != mappings[1].identity
    assert mappings[0][:1] == b"a" and mappings[1][:1] == b"b"


def test_unpinning_more_than_pinned_is_refused(exported: list[dict]) -> None:
    fake = DriverLikeRegistrar()
    with open(exported[0]["path"], "rb+") as f:
        mapping = file_mapping.open_file(f.fileno())
    mapping.pin(fake)
    mapping.unpin()
    with pytest.raises(RuntimeError, match="unpinned more than pinned"):
        mapping.unpin()
    assert fake.ranges == {} and fake.faults == []


@pytest.mark.gpu
def test_gpu_a_dropped_mapping_leaves_no_registration_behind(tmpfs_dir: str) -> None:
    """The H200 failure (cudaError 712): a registered mapping dropped without `unmap`, then the
    same file mapped again, where the kernel puts the new mapping over the old range."""
    kv, handles = segment.create_segments(LAYOUT, "cpu", tmpfs_dir, "remap")  # files, no CUDA
    del kv  # this process keeps no mapping of them: each map below is a fresh one
    gc.collect()
    host = [h for h in handles if h["name"] == "host_kv"]
    try:
        for _ in range(4):
            mapped = SegmentMap().map_extra(host, "cuda")["host_kv"]
            assert mapped.is_pinned()
            del mapped
            gc.collect()
        first, second = SegmentMap(), SegmentMap()
        a, b = first.map_extra(host, "cuda"), second.map_extra(host, "cuda")
        assert a["host_kv"].data_ptr() == b["host_kv"].data_ptr() and a["host_kv"].is_pinned()
        first.unmap(a)
        assert b["host_kv"].is_pinned(), "one client's unmap unregistered the other's pages"
        second.unmap(b)
        assert not b["host_kv"].is_pinned()
    finally:
        segment.remove_segments(tmpfs_dir, "remap")

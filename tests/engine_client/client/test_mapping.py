"""The service's memory mapped here (`client/mapping.py`): mapped as the service's own (a write
on one side is read on the other), a failed mapping leaves nothing mapped, and the owner's files
tell whether the memory can still be trusted."""

from __future__ import annotations

import os

import pytest

from contract.codec import handle_to_proto, layout_to_proto
from contract.errors import LayoutMismatch
from engine_client.client.mapping import Mapping
from kv_service.memory import segment
from proto.kvcache.v1 import kvcache_pb2 as pb
from tests.service_harness import TINY

LAYOUT = TINY  # a small valid layout


@pytest.fixture
def exported(tmp_path):
    """The service side: every KV tensor exported as a file, and the Attach reply naming them."""
    kv, handles = segment.create_segments(LAYOUT, "cpu", str(tmp_path), "t")
    reply = pb.AttachResponse(
        layout=layout_to_proto(LAYOUT), device="cpu", tensors=[handle_to_proto(h) for h in handles]
    )
    yield kv, handles, reply
    segment.remove_segments(str(tmp_path), "t")


def test_the_mapped_memory_is_the_services(exported) -> None:
    kv, _, reply = exported
    mapping = Mapping("unix:/kv.sock")
    mapping.map(reply, LAYOUT, "cpu", swap=False)
    assert mapping.mapped and mapping.owner_alive() and mapping.exchange == {}
    kv.page_table[1, 2] = 7  # the service writes ...
    assert mapping.tensors.page_table[1, 2] == 7  # ... and this process reads it
    assert mapping.unmap() == []  # no CUDA IPC on a CPU service
    assert not mapping.mapped and mapping.owner_alive()  # nothing mapped: nothing to distrust


def test_a_replaced_file_means_the_owner_is_gone(exported) -> None:
    _, handles, reply = exported
    mapping = Mapping("unix:/kv.sock")
    mapping.map(reply, LAYOUT, "cpu", swap=False)
    path = next(h["path"] for h in handles if h["name"] == "host_kv")
    os.rename(path, path + ".old")
    with open(path, "wb"):  # a restarted service under the same name: another file
        pass
    assert not mapping.owner_alive()
    os.replace(path + ".old", path)


def test_remote_swap_without_an_exchange_maps_nothing(exported) -> None:
    _, _, reply = exported
    mapping = Mapping("unix:/kv.sock")
    with pytest.raises(LayoutMismatch, match="no exchange tensors"):
        mapping.map(reply, LAYOUT, "cpu", swap=True)
    assert not mapping.mapped and mapping.tensors is None

"""Attaching (`client/attachment.py` and `client/mapping.py`): nothing in a service's reply is
used before it is checked, the memory it describes is mapped as the service's own (a write on
one side is read on the other), a failed mapping leaves nothing mapped, and the owner's files
tell whether the memory can still be trusted."""

from __future__ import annotations

import os

import pytest

from contract.codec import handle_to_proto, layout_to_proto
from contract.errors import LayoutMismatch
from contract.layout import MODE_OFFLOADED, KVLayout
from engine_client.client import attachment
from engine_client.client.control import HeldRequest
from engine_client.client.mapping import Mapping
from kv_service.memory import segment
from proto.kvcache.v1 import kvcache_pb2 as pb

LAYOUT = KVLayout(
    num_layers=1,
    max_requests=2,
    hot_slots=8,
    window=2,
    topk=4,
    page_size=4,
    num_pages=8,
    max_context=32,
)


@pytest.fixture
def exported(tmp_path):
    """The service side: every KV tensor exported as a file, and the Attach reply naming them."""
    kv, handles = segment.create_segments(LAYOUT, "cpu", str(tmp_path), "t")
    reply = pb.AttachResponse(
        layout=layout_to_proto(LAYOUT), device="cpu", tensors=[handle_to_proto(h) for h in handles]
    )
    yield kv, handles, reply
    segment.remove_segments(str(tmp_path), "t")


def test_the_request_carries_the_expected_layout_only_when_given() -> None:
    req = attachment.request("eng", "s1", True, LAYOUT, "fp")
    assert (req.engine_name, req.resume_session_id, req.remote_swap, req.model_fingerprint) == (
        "eng",
        "s1",
        True,
        "fp",
    )
    assert req.expected_layout == layout_to_proto(LAYOUT)
    assert not attachment.request("eng", "", False, None).HasField("expected_layout")


def test_a_reply_is_checked_before_anything_is_used() -> None:
    ok = pb.AttachResponse(layout=layout_to_proto(LAYOUT), device="cpu")
    assert attachment.check_reply(ok, LAYOUT) == (LAYOUT, "cpu")
    assert attachment.check_reply(ok, None) == (LAYOUT, "cpu")
    other = KVLayout(**{**LAYOUT.to_dict(), "topk": 2})
    with pytest.raises(LayoutMismatch, match="is not"):
        attachment.check_reply(ok, other)
    broken = pb.AttachResponse(
        layout=pb.Layout(**{**LAYOUT.to_dict(), "page_size": 0}), device="cpu"
    )
    with pytest.raises(LayoutMismatch, match="service layout:"):
        attachment.check_reply(broken, None)
    with pytest.raises(LayoutMismatch, match="unknown device 'tpu'"):
        attachment.check_reply(
            pb.AttachResponse(layout=layout_to_proto(LAYOUT), device="tpu"), None
        )


def test_a_gpu_this_engine_cannot_see_is_refused() -> None:
    with pytest.raises(LayoutMismatch, match="GPU-none is not visible"):
        attachment.cuda_device_with_uuid("GPU-none")


def test_held_requests_are_read_from_the_reply() -> None:
    state = pb.RequestState(
        request_id="r",
        slot=1,
        mode=MODE_OFFLOADED,
        seq_len=9,
        prompt_len=5,
        max_new_tokens=4,
        cached_tokens=4,
    )
    held = attachment.held_requests(pb.AttachResponse(requests=[state]))
    assert held == (HeldRequest("r", 1, MODE_OFFLOADED, 9, 5, 4, 4),)


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

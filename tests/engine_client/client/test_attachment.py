"""Attaching (`client/attachment.py`): the Attach request says what the engine expects, and
nothing in a service's reply is used before it is checked (layout, device, GPU)."""

from __future__ import annotations

import pytest

from contract.codec import layout_to_proto
from contract.errors import LayoutMismatch
from contract.layout import MODE_OFFLOADED, KVLayout
from engine_client.client import attachment
from engine_client.client.control import HeldRequest
from proto.kvcache.v1 import kvcache_pb2 as pb
from tests.service_harness import TINY

LAYOUT = TINY  # a small valid layout


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

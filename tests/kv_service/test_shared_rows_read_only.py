"""A poisoned write to a shared row is refused (issue 40): the rows of a request's cached prefix
live in shared pages, read-only and named by their content, which other requests read. Every
message by which an engine tells the service what it wrote (Commit, StepEnd, Prefilled) is
refused with SHARED_ROW_WRITE (contract.errors.SharedRowWrite, INVALID_ARGUMENT: the one
mapping, transport.status) when its stored length falls below the cached prefix, changes
nothing, and the shared pages' bytes (KV rows and index keys) stay as they were. The engine
itself never plans such a write: its batch builder refuses a prefill below the cached prefix
with the same error (the appends of every KV mode are checked against the shared pages in
tests/integration/test_prefix_engine.py).

Through a real service process on CPU; the test maps the service's memory (/dev/shm files) as
an engine does, to write the first request's rows and to read the shared pages back."""

from __future__ import annotations

import hashlib

import grpc
import pytest
import torch

from contract.errors import SharedRowWrite
from contract.layout import KVLayout
from contract.prefix import page_hashes
from contract.segment_map import SegmentMap
from engine_client.loop.batch_builder import BatchBuilder
from engine_client.loop.request import GenRequest, Phase, SamplingParams
from engine_client.loop.synthetic import SyntheticContext
from proto.kvcache.v1 import kvcache_pb2 as pb
from tests.process_harness import workdir
from tests.service_harness import TINY, ServiceProcess, SessionClient, attach, handles_from_proto

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# P = 4, W = 4, B = 16; the shared hot region takes one request slot's buffers.
LAYOUT = KVLayout(**{**TINY.to_dict(), "num_pages": 32, "shared_slots": 16})
PROMPT = list(range(100, 130))  # 30 tokens: 7 full pages
P = LAYOUT.page_size


@pytest.fixture(scope="module")
def svc():
    with workdir("hsro") as path:
        service = ServiceProcess(
            path, "ro", "--lease-seconds", "30", "--drain-timeout", "2", layout=LAYOUT
        )
        try:
            yield service.start().wait_serving()
            assert service.stop() == 0, service.log()
            assert service.segment_files() == [], service.log()
        finally:
            service.kill()


def _admit(s: SessionClient, rid: str, tokens: list[int]) -> pb.Admitted:
    reply = s.send(
        admit=pb.Admit(
            request_id=rid,
            prompt_len=len(tokens),
            max_new_tokens=4,
            page_hashes=page_hashes(tokens, P),
        )
    )
    assert reply.HasField("admitted"), reply
    return reply.admitted


def _digest(kv, pages: list[int]) -> str:
    rows = kv.host_kv[pages].contiguous().view(torch.uint8)
    keys = kv.index_pool[:, pages].contiguous().view(torch.uint8)
    return hashlib.sha256(rows.numpy().tobytes() + keys.numpy().tobytes()).hexdigest()


def _refused(reply: pb.SessionReply) -> bool:
    return (
        reply.HasField("error")
        and reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        and reply.error.reason == SharedRowWrite.reason
    )


def test_writes_below_the_cached_prefix_are_refused_and_change_nothing(svc) -> None:
    att = attach(svc, model_fingerprint="model-a")
    handles = [h for h in handles_from_proto(att.tensors) if not h["name"].startswith("shared_")]
    segments = SegmentMap()
    kv = segments.map_segments(LAYOUT, handles, "cpu")
    s = SessionClient(svc, att)
    try:
        a = _admit(s, "a", PROMPT)
        for t in range(len(PROMPT)):  # the engine's prefill of the first request
            page = a.pages[t // P]
            kv.host_kv[page, :, t % P] = t + 1
            kv.index_pool[:, page, t % P] = t + 1
        assert s.send(commit=pb.Commit(request_id="a", seq_len=len(PROMPT))).HasField("ack")
        b = _admit(s, "b", PROMPT + [1, 2, 3])
        assert b.cached_tokens == 28 and list(b.pages[:7]) == list(a.pages[:7])
        shared = list(b.pages[:7])
        before = _digest(kv, shared)
        stats = svc.stub().GetStats(pb.GetStatsRequest())
        poisoned = [
            {"commit": pb.Commit(request_id="b", seq_len=27)},
            {"commit": pb.Commit(request_id="b", seq_len=0)},
            {"prefilled": pb.Prefilled(request_id="b", seq_len=20)},
            # All or nothing: the good entry of a refused StepEnd is not committed either.
            {
                "step_end": pb.StepEnd(
                    progress=[
                        pb.RequestProgress(request_id="a", seq_len=31),
                        pb.RequestProgress(request_id="b", seq_len=5),
                    ],
                    hits=3,
                )
            },
        ]
        for body in poisoned:
            reply = s.send(**body)
            assert _refused(reply), (body, reply)
            assert reply.error.details["cached_tokens"] == "28"
        after = svc.stub().GetStats(pb.GetStatsRequest())
        assert after.hits == stats.hits and after.host_pages == stats.host_pages
        assert _digest(kv, shared) == before
        # The request's own rows are its to write: from its cached prefix on.
        assert s.send(commit=pb.Commit(request_id="b", seq_len=28)).HasField("ack")
        assert s.send(prefilled=pb.Prefilled(request_id="b", seq_len=33)).HasField("ack")
        for rid in ("a", "b"):
            assert s.release(rid).HasField("ack")
        assert svc.stub().Flush(pb.FlushRequest()).pages_freed == 8
        assert s.send(detach=pb.Detach()).HasField("ack")
    finally:
        s.close()
        segments.unmap(kv)


def test_the_engine_never_plans_a_prefill_into_its_cached_prefix() -> None:
    builder = BatchBuilder(4, 8, SyntheticContext(), 0, lambda: 0.0)
    req = GenRequest("r", tuple(PROMPT), 4, SamplingParams(), slot=0, cached_tokens=24)
    req.phase, req.prefilled = Phase.PREFILL, 16  # as a resume that lost its place would
    with pytest.raises(SharedRowWrite):
        builder.build([req], 1)
    req.prefilled = 24
    batch = builder.build([req], 2)
    assert batch is not None and [(c.start, c.end) for c in batch.prefills] == [(24, 30)]

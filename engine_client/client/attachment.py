"""Attaching to a KV service: the Attach request, the call and what its failure means, the
checks on its reply, and the mapping of the memory the reply describes (the `KVClient` keeps
what the reply says of its session).

The reply comes from another process, so nothing in it is used before it is checked: a layout,
device or tensor that is not what this engine expects is a `LayoutMismatch`, never memory read
with the wrong shapes.
"""

from __future__ import annotations

import grpc

from contract import errors, segment_map
from contract.codec import handle_from_proto, layout_from_proto, layout_to_proto
from contract.layout import KVLayout, LayoutError
from contract.tensors import KVTensors
from engine_client.client import reachability
from engine_client.client.control import HeldRequest
from engine_client.client.status import code_of, rpc_errors
from proto.kvcache.v1 import kvcache_pb2 as pb
from proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc


def cuda_device_with_uuid(uuid: str) -> str:
    """The visible CUDA device ("cuda:N") whose UUID is `uuid` (nvidia-smi form, "GPU-...")."""
    import torch

    for i in range(torch.cuda.device_count()):
        if f"GPU-{torch.cuda.get_device_properties(i).uuid}" == uuid:
            return f"cuda:{i}"
    raise errors.LayoutMismatch(
        f"the service's GPU {uuid} is not visible to this engine: "
        "run both on the same GPU (CUDA_VISIBLE_DEVICES)"
    )


def request(
    engine_name: str,
    resume: str,
    remote_swap: bool,
    expected: KVLayout | None,
    fingerprint: str = "",
) -> pb.AttachRequest:
    req = pb.AttachRequest(
        engine_name=engine_name,
        resume_session_id=resume,
        remote_swap=remote_swap,
        model_fingerprint=fingerprint,
    )
    if expected is not None:
        req.expected_layout.CopyFrom(layout_to_proto(expected))
    return req


async def call(
    channel: grpc.aio.Channel,
    req: pb.AttachRequest,
    *,
    target: str,
    peer: reachability.Peer,
    timeout: float,
    metadata: tuple[tuple[str, str], ...],
    wait: bool,
) -> pb.AttachResponse:
    """Attach on `channel` (to `target`); `wait`: wait for it to connect within `timeout`. A
    failure says what it means at attach: a refused argument is our layout, a wait that ran out
    is nothing there (`peer`, who should answer, words it), UNIMPLEMENTED is another server."""
    stub = pb_grpc.KVCacheServiceStub(channel)
    try:
        with rpc_errors("Attach"):
            return await stub.Attach(req, timeout=timeout, metadata=metadata, wait_for_ready=wait)
    except errors.InvalidArgument as e:
        # The only argument the service checks at attach is our layout.
        raise errors.LayoutMismatch(e.message, e.details) from e
    except errors.DeadlineExceeded as e:
        if not wait or channel.get_state() is grpc.ChannelConnectivity.READY:
            raise
        # wait_for_ready waited the deadline out for a connection: say what is at the path.
        raise reachability.unreachable(peer, target, timeout) from e
    except errors.KVError as e:
        if code_of(e) is not grpc.StatusCode.UNIMPLEMENTED:
            raise
        raise (await reachability.wrong_peer(channel, peer, target)) or e


def check_reply(reply: pb.AttachResponse, expected: KVLayout | None) -> tuple[KVLayout, str]:
    """The reply's layout, and its device as this process names it ("cpu" or "cuda:N")."""
    try:
        layout = layout_from_proto(reply.layout)
    except LayoutError as e:
        raise errors.LayoutMismatch(f"service layout: {e}") from e
    if expected is not None and layout != expected:
        raise errors.LayoutMismatch(f"service layout {layout} is not {expected}")
    if reply.device not in ("cpu", "cuda"):
        raise errors.LayoutMismatch(f"service reports unknown device {reply.device!r}")
    device = cuda_device_with_uuid(reply.gpu_uuid) if reply.device == "cuda" else "cpu"
    return layout, device


def held_requests(reply: pb.AttachResponse) -> tuple[HeldRequest, ...]:
    return tuple(
        HeldRequest(
            r.request_id,
            r.slot,
            int(r.mode),
            r.seq_len,
            r.prompt_len,
            r.max_new_tokens,
            r.cached_tokens,
        )
        for r in reply.requests
    )


def map_memory(
    reply: pb.AttachResponse,
    layout: KVLayout,
    device: str,
    remote_swap: bool,
    segments: segment_map.SegmentMap,
) -> tuple[KVTensors, dict, list[dict]]:
    """The KV tensors and exchange tensors the reply exports, mapped here, and the handles of
    the service's files, which tell whether it is still alive. The shared hot region's
    tensors, exported to the session that holds the region (kv_service.memory.region_lease),
    are mapped too and become the KV tensors' `shared`; the exchange dict keeps them for the
    unmap."""
    handles = [handle_from_proto(h) for h in reply.tensors]
    extra = [h for h in handles if h["name"].startswith(("xchg_", "shared_"))]
    kv_handles = [h for h in handles if h not in extra]
    try:
        tensors = segments.map_segments(layout, kv_handles, device)
    except (LayoutError, OSError) as e:
        raise errors.LayoutMismatch(f"cannot map the service's memory: {e}") from e
    try:
        exchange = segments.map_extra(extra, device) if extra else {}
        if remote_swap and not any(n.startswith("xchg_") for n in exchange):
            raise LayoutError("remote swap asked but no exchange tensors exported")
        region = {n: t for n, t in exchange.items() if n.startswith("shared_")}
        if region:
            from contract.shared_region import SharedRegion  # torch: not at import time

            tensors.shared = SharedRegion.of(layout, layout.shared_slots, region, tensors.device)
    except BaseException as e:
        # The KV tensors are mapped already: nothing else would ever unmap them.
        segments.unmap(tensors)
        segments.forget_files(kv_handles)
        del tensors  # the traceback keeps this frame, not the mappings
        if isinstance(e, (LayoutError, OSError)):
            raise errors.LayoutMismatch(f"cannot map the service's memory: {e}") from e
        raise
    # The shm files carry the service's pid; checking them is a stat and a kill(pid, 0).
    return tensors, exchange, [h for h in kv_handles if h["kind"] == "shm"]

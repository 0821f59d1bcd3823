"""Proto <-> contract conversions of the kvcache.v1 messages both sides build or read: the layout
descriptor and the tensor handles of the Attach reply. One place, so the service's encoder and
the client's decoder cannot drift apart; also the NIXL transfer target of
disaggregation (protobuf only: no gRPC here)."""

from __future__ import annotations

import dataclasses

from contract.layout import KVLayout
from contract.transfer_target import Region, TransferTarget
from proto.kvcache.v1 import kvcache_pb2 as pb

# Field names of a handle dict (contract.handle) that differ from the proto's.
_HANDLE_FIELDS = {
    "name": "name",
    "kind": "kind",
    "shape": "shape",
    "dtype": "dtype",
    "path": "shm_path",
    "ipc": "cuda_ipc",
    "nbytes": "nbytes",
}


def layout_to_proto(layout: KVLayout) -> pb.Layout:
    return pb.Layout(**layout.to_dict())


def layout_from_proto(msg: pb.Layout) -> KVLayout:
    """The layout a message describes; LayoutError if it is not a valid one."""
    return KVLayout(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(KVLayout)})


def handle_to_proto(h: dict) -> pb.TensorHandle:
    return pb.TensorHandle(**{field: h[key] for key, field in _HANDLE_FIELDS.items()})


def handle_from_proto(msg: pb.TensorHandle) -> dict:
    h = {key: getattr(msg, field) for key, field in _HANDLE_FIELDS.items()}
    h["shape"] = list(h["shape"])
    return h


def target_to_proto(t: TransferTarget) -> pb.TransferTargetResponse:
    return pb.TransferTargetResponse(
        agent_name=t.agent_name,
        agent_metadata=t.metadata,
        regions=[pb.MemoryRegion(**dataclasses.asdict(r)) for r in t.regions],
        layout=layout_to_proto(t.layout),
    )


def target_from_proto(msg: pb.TransferTargetResponse) -> TransferTarget:
    """The target a message describes; LayoutError if its layout is not a valid one."""
    fields = [f.name for f in dataclasses.fields(Region)]
    regions = tuple(Region(**{f: getattr(r, f) for f in fields}) for r in msg.regions)
    layout = layout_from_proto(msg.layout)
    return TransferTarget(msg.agent_name, msg.agent_metadata, regions, layout)

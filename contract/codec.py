"""Proto <-> contract conversions of the kvcache.v1 messages both sides build or read: the layout
descriptor and the tensor handles of the Attach reply. One place, so the service's encoder and
the client's decoder cannot drift apart (protobuf only: no gRPC here)."""

from __future__ import annotations

import dataclasses

from contract.layout import KVLayout
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

"""The contract between the KV service and its clients: what both sides import, and what imports
neither side (no `kv_service`, no `engine_client`, no gRPC).

- `layout`: `KVLayout`, the layout descriptor both sides must agree on, and the residency modes
- `tensors`: `KVTensors`, the shared tensor set, and the shapes a layout implies
- `handle`: one shared tensor described to another process (and the segment file names)
- `segment_map`: the mapping side: map, unmap, is the exporter still alive
- `exchange`: the remote-swap exchange tensors and interprocess events
- `errors`: the error taxonomy and its rich-status details
"""

from contract.grpc_fork import disable_grpc_fork_handlers

disable_grpc_fork_handlers()  # before any module of ours loads gRPC (see contract/grpc_fork.py)

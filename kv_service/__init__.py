"""HiSparse KV service: owns one GPU's KV memory and serves its control plane over gRPC.

Import submodules explicitly (kv_service.core, kv_service.rpc.server, ...): this package imports
nothing but the gRPC fork setting, so that light users (pool tests, --help) do not load torch or
grpc.
"""

from contract.grpc_fork import disable_grpc_fork_handlers

disable_grpc_fork_handlers()  # before any module of ours loads gRPC (see contract/grpc_fork.py)

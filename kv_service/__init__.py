"""HiSparse KV service: owns one GPU's KV memory and serves its control plane over gRPC.

Import submodules explicitly (kv_service.core, kv_service.rpc.server, ...): this package imports
nothing so that light users (pool tests, --help) do not load torch or grpc.
"""

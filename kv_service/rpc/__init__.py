"""The RPC wing: the gRPC server, its servicer, interceptor, status mapping and metrics."""

"""The contract between the KV service and its clients: what both sides import, and what imports
neither side (no `kv_service`, no `engine_client`, no gRPC)."""

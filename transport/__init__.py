"""Transport code both sides share and contract must not hold: the gRPC server scaffold
(health, reflection, keepalive), the per-call handling of both servers and their processes'
garbage collector (gc_heap). Imports contract and proto, never kv_service or engine_client."""

"""Transport code both sides share and contract must not hold: the gRPC server scaffold
(health, reflection, keepalive) and the per-call handling of both servers. Imports contract and
proto, never kv_service or engine_client."""

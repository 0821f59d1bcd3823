"""A real service's /metrics after a few RPCs: the go-grpc-prometheus series with their labels
and status codes, and the naming conventions (no `_total` on gauges, base units)."""

from __future__ import annotations

import os
import shutil
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_harness import ServiceProcess, SessionClient, attach, free_port, short_tmpdir

from proto.kvcache.v1 import kvcache_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SERVICE = "kvcache.v1.KVCacheService"


def scrape(port: int) -> dict[str, list]:
    """{family name: [samples]} of the text exposition."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def value(families: dict, sample: str, **labels: str) -> float:
    for _, samples in families.values():
        for s in samples:
            if s.name == sample and s.labels == labels:
                return s.value
    raise AssertionError(f"no {sample}{labels}")


def _has(families: dict, sample: str, **labels: str) -> bool:
    return any(s.name == sample and s.labels == labels for _, ss in families.values() for s in ss)


def _scrape_until(port: int, counted, timeout: float = 10.0) -> dict[str, list]:
    """A scrape in which `counted(families)` holds (another process's counters: polled)."""
    deadline = time.monotonic() + timeout
    while not counted(m := scrape(port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return m


def rpc(method: str, kind: str = "unary", **more: str) -> dict[str, str]:
    return dict(grpc_type=kind, grpc_service=SERVICE, grpc_method=method, **more)


def test_grpc_server_series_count_every_rpc_by_code() -> None:
    port, workdir = free_port(), short_tmpdir("kvsvc-m")
    svc = ServiceProcess(workdir, f"m{os.getpid()}", "--metrics-port", str(port), token="s3cret")
    try:
        svc.start().wait_serving()
        session = SessionClient(svc, attach(svc))
        assert session.admit("r1", 4, 4).HasField("admitted")
        assert session.release("r1").HasField("ack")
        session.close()
        svc.stub().GetStats(pb.GetStatsRequest(), metadata=svc.metadata)
        svc.stub().Flush(pb.FlushRequest(), metadata=svc.metadata)
        with pytest.raises(grpc.RpcError) as wrong_epoch:
            svc.stub().RemoteSwap(
                pb.RemoteSwapRequest(session_id="x", epoch=12345, layer=0), metadata=svc.metadata
            )
        assert wrong_epoch.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as no_token:
            svc.stub().GetStats(pb.GetStatsRequest())
        assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED

        handled = "grpc_server_handled_total"
        # A call is counted after its status went out: wait for the last ones' counts.
        m = _scrape_until(
            port,
            lambda m: (
                _has(m, handled, **rpc("GetStats", grpc_code="UNAUTHENTICATED"))
                and _has(m, handled, **rpc("Session", "bidi_stream", grpc_code="OK"))
            ),
        )
        assert value(m, handled, **rpc("Attach", grpc_code="OK")) == 1
        assert value(m, handled, **rpc("GetStats", grpc_code="OK")) == 1
        assert value(m, handled, **rpc("GetStats", grpc_code="UNAUTHENTICATED")) == 1
        assert value(m, handled, **rpc("RemoteSwap", grpc_code="FAILED_PRECONDITION")) == 1
        assert value(m, handled, **rpc("Session", "bidi_stream", grpc_code="OK")) == 1
        assert value(m, "grpc_server_started_total", **rpc("GetStats")) == 2
        assert (
            value(
                m,
                "grpc_server_handling_seconds_count",
                **rpc("RemoteSwap", grpc_code="FAILED_PRECONDITION"),
            )
            == 1
        )
        assert value(m, "grpc_server_handling_seconds_count", **rpc("Attach", grpc_code="OK")) == 1
        assert value(m, "kvs_session_message_seconds_count", message="admit", code="OK") == 1
        assert value(m, "kvs_session_message_seconds_count", message="release", code="OK") == 1
        assert m["grpc_server_handling_seconds"][0] == "histogram"
        assert m["grpc_server_handled"][0] == "counter"
        assert value(m, "kvs_admitted_total") == 1
        assert value(m, "kvs_device_slots_capacity") > 0
        assert value(m, handled, **rpc("Flush", grpc_code="OK")) == 1
        # Prefix cache: lookups, tokens looked up / found, evictions; cached and evictable pages.
        for counter in ("lookups", "lookup_tokens", "hit_tokens", "evicted_pages"):
            assert value(m, f"kvs_prefix_{counter}_total") == 0
        assert value(m, "kvs_prefix_cached_pages") == value(m, "kvs_prefix_evictable_pages") == 0
        for name, (kind, samples) in m.items():
            if kind == "gauge":
                assert not name.endswith("_total"), name
            if kind == "counter":
                assert all(s.name.endswith(("_total", "_created")) for s in samples), name
            assert not {"ms", "us", "milliseconds", "microseconds", "kb", "mib"} & set(
                name.split("_")
            ), name
    finally:
        svc.stop()
        shutil.rmtree(workdir, ignore_errors=True)

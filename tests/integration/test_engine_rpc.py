"""The engine's own gRPC server, as the KV service's (CPU, a real `serve` process):

- a Generate whose bytes do not parse, or whose resume id is not UTF-8, is answered
  INVALID_ARGUMENT (it was UNKNOWN), and the engine logs no traceback for it;
- a resume id over the service's id bound is INVALID_ARGUMENT (it was RESOURCE_EXHAUSTED);
- every call is counted in the grpc_server_* series, by status code;
- the metrics name device time "device" and say which device (a CPU run is not "gpu").
"""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from contract.ids import MAX_ID_BYTES
from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc
from tests.process_harness import start_engine, workdir
from tests.service_harness import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

GENERATE = "/decode.v1.DecodeService/Generate"
# Field 4 (resume_request_id), length-delimited, 2 bytes that are not UTF-8.
NOT_UTF8_RESUME_ID = bytes([(4 << 3) | 2, 2, 0xFF, 0xFE])
NOT_PROTOBUF = b"\xff\xff\xff\xff"


def _raw_generate(target: str, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_stream(GENERATE)  # no serializers: the bytes go as they are
        with pytest.raises(grpc.RpcError) as err:
            list(call(payload, timeout=10))
    return err.value


def _samples(port: int) -> list[tuple[str, dict, float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [
        (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
    ]


def _handled(samples: list[tuple[str, dict, float]]) -> dict[str, float]:
    return {
        labels["grpc_code"]: value
        for name, labels, value in samples
        if name == "grpc_server_handled_total" and labels["grpc_method"] == "Generate"
    }


def _until_handled(port: int, want: dict[str, float], timeout: float = 10.0):
    """The samples once Generate's handled counts are `want` (another process: polled)."""
    deadline = time.monotonic() + timeout
    while _handled(samples := _samples(port)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _handled(samples) == want, _handled(samples)
    return samples


def test_resume_ids_are_bounded_as_the_service_bounds_ids() -> None:
    """A resume id over the service's id bound (or not printable) is INVALID_ARGUMENT with a
    message naming the bound; it was RESOURCE_EXHAUSTED (the NOT_FOUND message quoted the id,
    and 20 KB of it did not fit in gRPC's metadata). An unknown id within it stays NOT_FOUND."""
    with workdir("hsg") as path:
        eng = start_engine(path, "baseline")
        try:
            with grpc.insecure_channel(eng.target) as channel:
                stub = pb_grpc.DecodeServiceStub(channel)
                for rid, code in (
                    ("x" * 20_000, grpc.StatusCode.INVALID_ARGUMENT),
                    ("x" * (MAX_ID_BYTES + 1), grpc.StatusCode.INVALID_ARGUMENT),
                    ("tab\there", grpc.StatusCode.INVALID_ARGUMENT),
                    ("x" * MAX_ID_BYTES, grpc.StatusCode.NOT_FOUND),
                ):
                    with pytest.raises(grpc.RpcError) as err:
                        list(stub.Generate(pb.GenerateRequest(resume_request_id=rid), timeout=10))
                    assert err.value.code() is code, err.value
                    if code is grpc.StatusCode.INVALID_ARGUMENT:
                        assert f"resume_request_id must be 1..{MAX_ID_BYTES} bytes" in (
                            err.value.details()
                        )
        finally:
            assert eng.stop() == 0, eng.log()


def test_malformed_generate_is_invalid_argument_and_every_call_is_counted() -> None:
    port = free_port()
    with workdir("hsg") as path:
        eng = start_engine(path, "baseline", extra=("--metrics-port", str(port)))
        try:
            for payload in (NOT_PROTOBUF, NOT_UTF8_RESUME_ID):
                err = _raw_generate(eng.target, payload)
                assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err
                assert "malformed message" in err.details()
            assert "Traceback" not in eng.log(None), eng.log()

            # The server counts a call after its status went out: wait for the second count.
            samples = _until_handled(port, {"INVALID_ARGUMENT": 2.0})
            started = [
                v
                for n, labels, v in samples
                if n == "grpc_server_started_total"
                and labels
                == {
                    "grpc_type": "server_stream",
                    "grpc_service": "decode.v1.DecodeService",
                    "grpc_method": "Generate",
                }
            ]
            assert started == [2.0]
            info = [labels for n, labels, _ in samples if n == "engine_info"]
            assert info == [{"device": "cpu", "kv_mode": "baseline"}]
            assert not [n for n, _, _ in samples if n.startswith("engine_") and "gpu" in n]
        finally:
            assert eng.stop() == 0, eng.log()

"""The service process's lifecycle: drain by RPC and by SIGTERM, the leftovers of a SIGKILLed
service removed by the next one, and the command line's flags, environment and validation."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2
from service_harness import (
    TINY,
    ServiceProcess,
    SessionClient,
    attach,
    free_port,
    short_tmpdir,
)

from contract.layout import KVLayout
from proto.kvcache.v1 import kvcache_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def listen_addresses(port: int) -> list[str]:
    """Local addresses of the TCP sockets listening on `port`, from /proc/net/tcp{,6}."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.split(":")
                if state == "0A" and int(hexport, 16) == port:
                    found.append(
                        socket.inet_ntop(
                            socket.AF_INET if len(addr) == 8 else socket.AF_INET6,
                            b"".join(
                                int(addr[i : i + 8], 16).to_bytes(4, "little")
                                for i in range(0, len(addr), 8)
                            ),
                        )
                    )
    return found


def test_drain_rpc_then_sigterm_waits_for_requests() -> None:
    workdir = short_tmpdir("kvsvc-d")
    port = free_port()
    svc = ServiceProcess(
        workdir, f"d{os.getpid()}", "--drain-timeout", "20", "--metrics-port", str(port)
    )
    try:
        svc.start().wait_serving()
        s = SessionClient(svc, attach(svc))
        assert s.admit("inflight", 4, 4).HasField("admitted")
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"kvs_requests 1.0" in scraped and b"kvs_index_pages_used 2.0" in scraped
        assert b'kvs_session_message_seconds_count{code="OK",message="admit"} 1.0' in scraped
        assert (
            b'grpc_server_handled_total{grpc_code="OK",grpc_method="Attach",'
            b'grpc_service="kvcache.v1.KVCacheService",grpc_type="unary"} 1.0'
        ) in scraped
        assert listen_addresses(port) == ["127.0.0.1"]
        drain = svc.stub().Drain(pb.DrainRequest(timeout_seconds=0.2))
        assert (drain.drained, drain.remaining_requests) == (False, 1)
        svc.wait_status(health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
        refused = s.admit("late", 4, 4).error
        assert refused.code == grpc.StatusCode.UNAVAILABLE.value[0]
        svc.signal(signal.SIGTERM)
        assert s.send(heartbeat=pb.Heartbeat()).ack.draining
        assert svc.proc.poll() is None, "stopped before the in-flight request was released"
        assert s.release("inflight").HasField("ack")
        assert svc.wait_exit(15) == 0, svc.log()
        assert not os.path.exists(svc.uds) and svc.segment_files() == []
        assert "drained: no request left" in svc.log()
    finally:
        svc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def test_sigkill_leftovers_removed_on_restart_and_drain_timeout() -> None:
    workdir = short_tmpdir("kvsvc-k")
    first = ServiceProcess(workdir, "crash")
    second = ServiceProcess(workdir, "crash", "--drain-timeout", "0.5")
    try:
        first.start().wait_serving()
        first.kill()
        assert first.segment_files() and os.path.exists(first.uds)
        second.start().wait_serving()
        pid = second.proc.pid
        assert all(
            f"-{pid}-" in name or name.endswith(f"-{pid}.lock") for name in second.segment_files()
        )
        assert "removed stale segment" in second.log() and "removed stale socket" in second.log()
        s = SessionClient(second, attach(second))
        s.admit("never-released", 4, 4)
        second.signal(signal.SIGTERM)
        while "drain timed out" not in second.log():  # then it stops, in a second
            time.sleep(0.02)
        stopping = s.send(heartbeat=pb.Heartbeat()).error  # typed, not the stream cut
        assert (stopping.code, stopping.reason) == (
            grpc.StatusCode.UNAVAILABLE.value[0],
            "STOPPING",
        )
        assert "1 request(s) still admitted" in stopping.message
        assert second.wait_exit(15) == 0, second.log()
        assert "drain timed out with 1 requests" in second.log()
        assert second.segment_files() == [] and not os.path.exists(second.uds)
    finally:
        first.kill()
        second.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def test_cli_flags_env_and_validation(capsys: pytest.CaptureFixture) -> None:
    from kv_service.__main__ import parse_config as parse

    env = {
        "KVS_NUM_PAGES": "40",
        "KVS_TOKEN": "from-env",
        "KVS_SOCKET_MODE": "660",
        "KVS_UDS": "/tmp/x.sock",
    }
    config, _ = parse(["--num-layers", "3", "--lease-seconds", "2.5"], env)
    assert (config.layout.num_pages, config.layout.num_layers, config.lease_seconds) == (40, 3, 2.5)
    assert (config.token, config.socket_mode, config.uds) == ("from-env", 0o660, "/tmp/x.sock")
    assert "from-env" not in repr(config)
    for bad in (
        ["--socket-mode", "644"],
        ["--uds", "/tmp/" + "x" * 120],
        ["--device", "tpu"],
        ["--lease-seconds", "0"],
        ["--window", "4096"],
        ["--tcp", "nonsense"],
    ):
        with pytest.raises(SystemExit) as err:
            parse(bad, {})
        assert err.value.code == 2, bad
    assert config.metrics_address == "127.0.0.1"
    assert parse([], {"KVS_METRICS_ADDRESS": "0.0.0.0"})[0].metrics_address == "0.0.0.0"
    assert parse(["--metrics-address", "::1"], {})[0].metrics_address == "::1"
    with pytest.raises(SystemExit):
        parse(["--metrics-address", "a b"], {})
    with pytest.raises(SystemExit):
        parse(["--help"], env)
    help_text = capsys.readouterr().out
    assert "KVS_NUM_PAGES" in help_text and "from-env" not in help_text


def test_start_up_failure_for_room_is_one_line_naming_the_flags() -> None:
    workdir = short_tmpdir("kvsvc-f")
    os.makedirs(os.path.join(workdir, "shm"))
    st = os.statvfs(os.path.join(workdir, "shm"))
    page_bytes = TINY.num_layers * TINY.page_size * TINY.row_bytes
    too_many = st.f_bavail * st.f_frsize // page_bytes + 1
    svc = ServiceProcess(
        workdir, "fail", layout=KVLayout(**(TINY.to_dict() | {"num_pages": too_many}))
    )
    try:
        svc.start()
        assert svc.wait_exit(60) == 1
        log = svc.log()
        # The cause, in one line, comes before the socket closes and "stopped".
        assert log.index("service cannot start: no room for") < log.index("stopped;"), log
        (line,) = [x for x in log.splitlines() if "no room for" in x]
        assert f"--num-pages {too_many}" in line and "is free" in line, line
        assert re.search(r"they need [0-9.]+ [kMG]B", line), line
        assert "Traceback" not in log and "Errno" not in log, log
        assert svc.segment_files() == []
    finally:
        svc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def test_second_service_on_one_shm_dir_leaves_the_first_alone() -> None:
    dirs = [short_tmpdir(f"kvsvc-{i}") for i in range(3)]
    shm = os.path.join(dirs[0], "shm")
    # Same instance while the first is alive, and another instance, on one shm dir.
    first = ServiceProcess(dirs[0], "shared", shm_dir=shm)
    second = ServiceProcess(dirs[1], "shared", shm_dir=shm)
    other = ServiceProcess(dirs[2], "other", shm_dir=shm)
    try:
        first.start().wait_serving()
        mine = first.segment_files()
        second.start().wait_serving()
        other.start().wait_serving()
        assert set(mine) <= set(first.segment_files())
        assert "removed stale segment" not in second.log() + other.log()
        s = SessionClient(first, attach(first))
        assert s.admit("still-served", 4, 4).HasField("admitted")
        assert s.release("still-served").HasField("ack")
        s.send(detach=pb.Detach())
        s.close()
        for svc in (second, other, first):
            assert svc.stop() == 0, svc.log()
        assert first.segment_files() == []
    finally:
        for svc in (first, second, other):
            svc.kill()
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)

"""gRPC's fork handlers stay off in our processes (contract/grpc_fork.py): a process that has
loaded one of our packages forks-to-exec while gRPC polls, and every child execs."""

import os
import subprocess
import sys

import pytest

from contract.grpc_fork import ENV
from engine_client.serve.procs import REPO_ROOT

# A fresh interpreter: imports the named package, then serves and connects over gRPC (poller
# threads running), then forks 40 children the way a preexec_fn or compute-sanitizer makes
# subprocess fork. Before the fix 5-7 of 40 children died by SIGSEGV with grpcio 1.85 on CPU.
_FORKS = """
import sys, importlib, subprocess
from concurrent import futures
importlib.import_module(sys.argv[1])
import grpc
server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
grpc.channel_ready_future(channel).result(timeout=10)
codes = [subprocess.run(["/bin/true"], preexec_fn=lambda: None).returncode for _ in range(40)]
print(sum(c != 0 for c in codes), "of", len(codes), "children failed")
sys.exit(1 if any(codes) else 0)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="fork-to-exec with gRPC's epoll poller")
@pytest.mark.parametrize("package", ["contract", "kv_service", "engine_client"])
def test_children_exec_after_fork_under_live_grpc(package: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV}  # the package must set it
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run(
        [sys.executable, "-c", _FORKS, package],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "fork_posix" not in done.stderr  # gRPC ran no fork handlers at all


def test_a_value_the_user_set_wins() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), **{ENV: "true"})
    code = f"import os, contract; print(os.environ[{ENV!r}])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "true", out.stderr

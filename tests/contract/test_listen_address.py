"""Claiming the address to listen on (issue 28 defect 7): the engine, like the KV service,
refuses a socket path where a live server listens or a file that is not a socket (it used to
unlink both), and a port in use (`serve --http`, `gateway`) is a one-line error, exit 1, not a
bind traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from contract.listen_address import AddressTaken, claim_socket_path

pytestmark = [pytest.mark.timeout(120)]
ENGINE = [sys.executable, "-m", "engine_client"]
LOCAL = ["--kv-mode", "baseline", "--device", "cpu", "--log-level", "INFO"]


def _listening_unix(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen()
    return s


def test_a_stale_socket_is_reused_a_live_one_or_a_file_refused(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    _listening_unix(stale).close()  # a socket file nobody listens on
    assert claim_socket_path(str(stale), "--uds", "engine") and not stale.exists()
    assert not claim_socket_path(str(stale), "--uds", "engine")  # nothing there
    with _listening_unix(tmp_path / "live.sock"):
        with pytest.raises(AddressTaken, match="another engine is listening"):
            claim_socket_path(str(tmp_path / "live.sock"), "--uds", "engine")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(AddressTaken, match="not a socket"):
        claim_socket_path(str(tmp_path / "notes.txt"), "--uds", "engine")


def _one_line_failures(commands: list[list[str]]) -> list[tuple[int, str]]:
    """(exit status, the one line of stderr) of each command, run side by side."""
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=100)
            lines = [x for x in err.splitlines() if x.strip() and "listening on" not in x]
            assert len(lines) == 1 and "Traceback" not in err, err
            out.append((p.returncode, lines[0]))
    finally:
        for p in procs:  # one that started after all (the old behaviour) must not outlive us
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_taken_addresses_are_one_line_errors_and_nothing_is_removed(tmp_path: Path) -> None:
    plain, live = tmp_path / "notes.txt", tmp_path / "live.sock"
    plain.write_text("mine")
    with _listening_unix(live) as server, socket.socket() as port:
        port.bind(("127.0.0.1", 0))
        port.listen()
        http = f"127.0.0.1:{port.getsockname()[1]}"
        results = _one_line_failures(
            [
                [*ENGINE, "serve", "--uds", str(plain), *LOCAL],
                [*ENGINE, "serve", "--uds", str(live), *LOCAL],
                [*ENGINE, "gateway", "--http", http, "--target", str(live)],
                [*ENGINE, "serve", "--uds", str(tmp_path / "e.sock"), "--http", http, *LOCAL],
            ]
        )
        assert [status for status, _ in results] == [1, 1, 1, 1], results
        assert "not a socket" in results[0][1] and "another engine" in results[1][1]
        assert all("port is in use" in line and http in line for _, line in results[2:])
        assert plain.read_text() == "mine"
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(live))  # still the live server's socket
        server.accept()[0].close()

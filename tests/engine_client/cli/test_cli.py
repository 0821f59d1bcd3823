"""The command line as a user meets it, each command run as a subprocess (CPU).

- a wrong `generate --target` or `serve --service` fails within the connect timeout (seconds,
  where it used to wait out a 120 s / 30 s deadline), names the address and how to fix it, and
  prints no traceback;
- `generate` prints the request id on stderr before any token, and `generate --resume ID` with
  that id gives the request's tokens;
- Ctrl-C (SIGINT) ends `generate` with status 130 and no traceback.
The subprocess timeouts are generous bounds against a hang, not timings.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from engine_client.serve.procs import REPO_ROOT, engine_process
from tests.process_harness import workdir

pytestmark = [pytest.mark.timeout(180)]

HANG_BOUND = 30  # seconds; the old behaviour took 127 s (generate) and 30 s + (serve)


def cli(*args: str, timeout: float = HANG_BOUND) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "engine_client", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_generate_with_a_wrong_target_fails_fast_and_says_where() -> None:
    with workdir("hcl") as path:
        sock = os.path.join(path, "no-engine.sock")
        # Nothing will listen: the connect wait always runs out, so a short one (it was 2 s,
        # idle time of a CI core) shows the same failure.
        out = cli("generate", "--target", sock, "--connect-timeout", "0.5")
        assert out.returncode == 1
        assert f"unix:{sock}" in out.stderr and "does not exist" in out.stderr
        assert "python -m engine_client serve" in out.stderr and "--target" in out.stderr
        assert "Traceback" not in out.stderr and "DEADLINE_EXCEEDED" not in out.stderr

        open(sock, "w").close()  # a file where no one listens: a stale socket
        out = cli("generate", "--target", sock, "--connect-timeout", "0.5")
        assert out.returncode == 1 and "nothing accepts connections" in out.stderr
        assert "Traceback" not in out.stderr


def test_serve_with_a_missing_service_socket_fails_fast_and_says_where() -> None:
    with workdir("hcl") as path:
        sock = os.path.join(path, "no-kv.sock")
        out = cli(
            "serve",
            "--kv-mode",
            "service",
            "--service",
            sock,
            "--device",
            "cpu",
            "--uds",
            os.path.join(path, "engine.sock"),
            "--attach-timeout",
            "0.5",  # as above: no service will listen
        )
        assert out.returncode == 1, out.stderr
        assert f"unix:{sock}" in out.stderr and "python -m kv_service --uds" in out.stderr
        assert "--service" in out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_generate_prints_the_request_id_first_and_it_resumes() -> None:
    with workdir("hcl") as path:
        eng = engine_process(
            path,
            "baseline",
            extra=[
                "--device",
                "cpu",
                "--max-context",
                "2048",
                "--max-requests",
                "2",
                "--max-batch",
                "2",
            ],
        )
        eng.start().wait_serving(60)
        try:
            target = eng.target.removeprefix("unix:")
            out = cli("generate", "--target", target, "--ids", "1,2,3", "--max-new-tokens", "6")
            assert out.returncode == 0, out.stderr
            first = out.stderr.splitlines()[0]
            match = re.fullmatch(r"request ([0-9a-f]+)", first)
            assert match, out.stderr
            request_id = match[1]
            tokens = out.stdout.splitlines()[0].split()
            assert len(tokens) == 6 and f"request {request_id}: 6 tokens" in out.stdout

            # Text in, text out: the text streams on stdout, then the summary line.
            text = cli(
                "generate", "--target", target, "--text", "héllo 你好", "--max-new-tokens", "6"
            )
            assert text.returncode == 0, text.stderr
            assert text.stdout.rstrip("\n").splitlines()[-1].startswith("request ")
            assert ": 6 tokens, LENGTH" in text.stdout
            chat = cli("generate", "--target", target, "--chat", "Hi", "--max-new-tokens", "3")
            assert chat.returncode == 0 and ": 3 tokens, LENGTH" in chat.stdout, chat.stderr
            words = cli("generate", "--target", target, "--ids", "hello world")
            assert words.returncode == 2 and "for text use --text" in words.stderr

            again = cli("generate", "--target", target, "--resume", request_id)
            assert again.returncode == 0, again.stderr
            assert again.stderr.splitlines()[0] == f"request {request_id}"
            assert again.stdout.splitlines()[0].split() == tokens

            # Ctrl-C mid-stream: quiet exit 130, also when pytest itself ignores SIGINT (a
            # background job does; its children inherit SIG_IGN unless the handler is reset).
            with _sigint_ignored():
                proc = _interruptible_generate(target)
            assert proc.stderr.readline().startswith("request ")
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=HANG_BOUND)
            assert proc.returncode == 130 and "Traceback" not in err, err
        finally:
            assert eng.stop() == 0, eng.log()


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT here meanwhile, as in a background job (`pytest &`)."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _interruptible_generate(target: str) -> subprocess.Popen:
    """A long `generate`, with the default SIGINT disposition whatever this process's is (as a
    terminal's foreground job has it), so that Ctrl-C reaches it."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine_client",
            "generate",
            "--target",
            target,
            "--max-new-tokens",
            "2000",
        ],
        cwd=REPO_ROOT,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )

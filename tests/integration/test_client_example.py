"""docs/CLIENT.md's example runs against a real service process, loads no `kv_service` module
on the engine's side, and is the very code the doc shows."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from service_harness import ServiceProcess, short_tmpdir

from engine_client.serve.procs import REPO_ROOT
from proto.kvcache.v1 import kvcache_pb2 as pb

EXAMPLE = REPO_ROOT / "docs" / "client_example.py"
DOC = REPO_ROOT / "docs" / "CLIENT.md"

# Runs the example as __main__ and then checks what it imported.
RUNNER = """
import runpy, sys
sys.argv = [sys.argv[1], sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "kv_service")
assert not loaded, f"the example loaded service modules: {loaded}"
"""


def test_example_decodes_against_a_service_process() -> None:
    workdir = short_tmpdir("client-example")
    svc = ServiceProcess(workdir, "example").start().wait_serving()
    try:
        # No TRITON_INTERPRET (issue 28 defect 8): kernels.interpreter must set it before triton.
        env = dict(
            {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
            PYTHONPATH=os.pathsep.join(
                p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        )
        done = subprocess.run(
            [sys.executable, "-c", RUNNER, str(EXAMPLE), f"unix:{svc.uds}"],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr + svc.log()
        swapped = re.fullmatch(r"rows swapped in: (\d+)\n", done.stdout)
        assert swapped and int(swapped[1]) > 0, done.stdout  # the request was offloaded
        stats = svc.stub().GetStats(pb.GetStatsRequest(), timeout=30, metadata=svc.metadata)
        assert stats.requests == 0 and stats.misses == int(swapped[1])  # released, reported
    finally:
        svc.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_doc_shows_the_example_file() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert EXAMPLE.read_text() in blocks

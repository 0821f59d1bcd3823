import os
import sys

import pytest
import torch

from tests.leftovers import Session

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Before any test makes a temporary file: every one goes under this session's own root. Under
# pytest-xdist every worker is a session of its own; the controller runs no test.
SESSION = Session.begin()
# The controller's: what its workers reported at their end (leftovers, kept roots).
FROM_WORKERS: dict[str, list[str]] = {"leftovers": [], "kept": []}


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): two workers on a CPU machine of two cores or more, as
    CI's; on a CUDA machine one process, so the GPU tests run one at a time as they always did.
    PYTEST_XDIST_AUTO_NUM_WORKERS, or `-n N` on the command line, overrides it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return 0 if torch.cuda.is_available() else min(2, os.cpu_count() or 1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist controller: a worker ended; keep what it reported for the session's end."""
    for key, lines in FROM_WORKERS.items():
        lines.extend(getattr(node, "workeroutput", {}).get(key, []))


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when it leaves temporary files, /dev/shm files or processes behind."""
    config = session.config
    worker = getattr(config, "workeroutput", None)
    # The controller's children are its workers, which end after this hook.
    left = SESSION.leftovers(processes=not config.pluginmanager.has_plugin("dsession"))
    left += FROM_WORKERS["leftovers"]
    kept = SESSION.end(keep=bool(left) or exitstatus != 0)
    kept_roots = [kept] if kept is not None else []
    if worker is not None:  # the controller reports (a worker's output is not shown)
        worker["leftovers"], worker["kept"] = left, kept_roots
        return
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        _report("=", [f"the test session left these behind ({len(left)}):", *left], config)
    # A failed session keeps its files (logs, pytest's tmp_path) for a look: say where.
    _report(
        "",
        [
            f"this session's temporary files are kept for a look (rm -r when done): {root}"
            for root in kept_roots + FROM_WORKERS["kept"]
        ],
        config,
    )


def _report(sep: str, lines: list[str], config) -> None:
    if not lines:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        print(*lines, sep="\n", file=sys.stderr)
        return
    if sep:
        reporter.write_sep(sep, "leftovers", red=True)
    for line in lines:
        reporter.write_line(line)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")

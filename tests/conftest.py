import tests.blas_threads  # noqa: F401  (before torch imports numpy)

# isort: split
import os
import sys

import pytest
import torch

from contract import cuda_shm
from tests.leftovers import Session

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One OpenMP thread per test process, as tests/blas_threads.py does for numpy: torch's
    # threads of two xdist workers spin against each other on CI's two cores.
    torch.set_num_threads(1)

# Before any test makes a temporary file: every one goes under this session's own root. Under
# pytest-xdist every worker is a session of its own; the controller runs no test.
SESSION = Session.begin()
cuda_shm.remove_own_at_exit()  # the CUDA driver's file of this process, if it makes one
# The controller's: what its workers reported at their end (leftovers, kept roots).
FROM_WORKERS: dict[str, list[str]] = {"leftovers": [], "kept": []}


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Two pytest-xdist workers on a CPU machine of two cores or more, as CI's, when xdist is
    installed (the `test` extra) and the command line does not say (`-n 0`: one process). On a
    CUDA machine one process, so the GPU tests run one at a time as they always did. Here rather
    than in pyproject's addopts, so that an environment without xdist still runs the tests. Runs
    before xdist's own hook, which turns the worker count into workers."""
    workers = min(2, os.cpu_count() or 1)
    if (
        hasattr(config, "workerinput")  # a worker itself
        or not config.pluginmanager.has_plugin("xdist")
        or config.getoption("numprocesses", None) is not None
        or config.getoption("usepdb", False)
        or torch.cuda.is_available()
        or workers < 2
    ):
        return None
    config.option.numprocesses = workers
    if config.option.dist == "no":
        # A worker out of tests takes some of the other's queue: one long test ends no run alone.
        config.option.dist = "worksteal"
    return None


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

import os
import sys

import pytest
import torch

from tests.leftovers import Session

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Before any test makes a temporary file: every one goes under this session's own root.
SESSION = Session.begin()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when it leaves temporary files, /dev/shm files or processes behind."""
    left = SESSION.leftovers()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if left:
        lines = [f"the test session left these behind ({len(left)}):", *left]
        if reporter is not None:
            reporter.write_sep("=", "leftovers", red=True)
            for line in lines:
                reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    kept = SESSION.end(keep=bool(left) or exitstatus != 0)
    if kept is not None:
        # A failed session keeps its files (logs, pytest's tmp_path) for a look: say where.
        message = f"this session's temporary files are kept for a look (rm -r when done): {kept}"
        if reporter is not None:
            reporter.write_line(message)
        else:
            print(message, file=sys.stderr)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")

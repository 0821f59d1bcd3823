from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def tmpfs_dir() -> Iterator[str]:
    """A fresh directory on tmpfs (in /dev/shm, named with the session's marker, which
    tests/leftovers.py checks), removed after: CUDA registers only tmpfs pages of a file (Linux
    >= 6.5), so a segment test never depends on where pytest's tmp_path lives."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    marker = os.path.basename(tempfile.gettempdir())  # the session's (tests/leftovers.py)
    path = tempfile.mkdtemp(prefix=f"{marker}-seg", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)

"""One BLAS thread per test process, set before anything imports numpy (tests/conftest.py imports
this module first, as the kernels import kernels.interpreter before triton).

Triton's interpreter runs each tl.dot through numpy, whose OpenBLAS starts a thread per core that
spins between calls. With two pytest-xdist workers on CI's two cores that is four spinning
threads on two cores: tests/engine_client/model/test_overlap.py's CPU test took 38 s of CPU
(28 s wall) instead of 22 s. The engine's own CPU mode keeps one torch thread for the same
reason (`serve --cpu-threads 1`). A value set by the caller wins.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

"""`python -m bench.kernels`: runs bench.kernels.cli."""

from bench.kernels.cli import main

raise SystemExit(main())

"""`python -m bench.mtp`: runs bench.mtp.cli."""

from bench.mtp.cli import main

raise SystemExit(main())

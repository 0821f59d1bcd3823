"""`python -m bench.e2e`: runs bench.e2e.cli."""

from bench.e2e.cli import main

raise SystemExit(main())

"""`python -m bench.disagg`: runs bench.disagg.cli."""

from bench.disagg.cli import main

raise SystemExit(main())

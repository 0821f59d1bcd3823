"""`python -m bench.bookkeeping`: runs bench.bookkeeping.cli."""

from bench.bookkeeping.cli import main

raise SystemExit(main())

"""`python -m bench.sanitize`: runs bench.sanitize.cli."""

from bench.sanitize.cli import main

raise SystemExit(main())

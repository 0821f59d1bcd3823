"""`python -m bench.prefix`: runs bench.prefix.cli."""

from bench.prefix.cli import main

raise SystemExit(main())

"""`python -m bench.gateway`: runs bench.gateway.cli."""

from bench.gateway.cli import main

raise SystemExit(main())

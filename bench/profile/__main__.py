"""`python -m bench.profile`: runs bench.profile.breakdown."""

from bench.profile.breakdown import main

raise SystemExit(main())

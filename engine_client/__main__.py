"""`python -m engine_client {serve,generate,demo}`: see engine_client/cli/main.py."""

import sys

from engine_client.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

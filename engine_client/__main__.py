"""`python -m engine_client {serve,generate,demo}`: see engine_client/cli/main.py."""

import sys

from contract import cuda_shm
from engine_client.cli.main import main

if __name__ == "__main__":
    cuda_shm.remove_own_at_exit()  # the CUDA driver leaves its file of a CUDA IPC user
    sys.exit(main())

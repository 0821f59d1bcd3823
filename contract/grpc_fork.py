"""gRPC's fork handlers, turned off in every process of ours before gRPC loads.

Our processes fork only to exec: subprocess starts the service and engine children, Triton runs
ptxas, the launcher execs the real program. gRPC's own fork support (on by default in grpcio)
restarts its poller in the forked child, and Python then closes that poller's descriptors
before exec: the child aborts with "epoll_wait error: Bad file descriptor" or dies by SIGSEGV
(grpc/grpc#43055, grpcio 1.81 and later). Plain subprocess spawns by vfork and runs no fork
handlers, which hid this until compute-sanitizer, which follows children by fork, started the
service (run U, synccheck's service-remote-swap mode). GRPC_ENABLE_FORK_SUPPORT is read when
gRPC loads, so the packages' `__init__` ask for this first; a value the user set wins.
"""

import os

ENV = "GRPC_ENABLE_FORK_SUPPORT"


def disable_grpc_fork_handlers() -> None:
    """Turn gRPC's fork support off for this process and its children, unless the environment
    already says otherwise. Too late (silently) once gRPC has loaded in this process."""
    os.environ.setdefault(ENV, "false")

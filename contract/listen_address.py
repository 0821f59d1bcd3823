"""Claiming an address to listen on, the same way for the KV service, the engine and the
gateway: a socket path left by a dead process is reused, a live one or a file that is not a
socket is refused (removing it would cut off a live server, or delete someone's file), and a
port in use is refused in one line rather than a bind traceback."""

from __future__ import annotations

import errno
import os
import socket
import stat


class AddressTaken(Exception):
    """The address to listen on belongs to someone else; the message names it and the fix."""


def _socket_in_use(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def claim_socket_path(path: str, flag: str, what: str) -> bool:
    """Make `path` free for a Unix socket: True if a stale socket was removed. AddressTaken for
    a live socket (another `what` listens there) or a file that is not a socket."""
    if not os.path.lexists(path):
        return False
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise AddressTaken(f"{flag} {path} exists and is not a socket: pick another path")
    if _socket_in_use(path):
        raise AddressTaken(
            f"{flag} {path}: another {what} is listening there: stop it or pick another path"
        )
    os.unlink(path)
    return True


def bind_failure(flag: str, address: str, err: OSError) -> AddressTaken | OSError:
    """The one-line error of a failed bind to HOST:PORT, or `err` itself if not an address
    problem (then its traceback is worth having)."""
    if err.errno == errno.EADDRINUSE:
        return AddressTaken(
            f"{flag} {address}: the port is in use: stop what listens there or pick another port"
        )
    if err.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
        return AddressTaken(f"{flag} {address}: cannot listen there ({err.strerror})")
    return err

"""The bound on the ids both sides hand out and take back (request, session, engine names): at
most MAX_ID_BYTES bytes of printable text, so that an id fits in an error message, a log line and
gRPC metadata whatever the caller sent."""

from __future__ import annotations

MAX_ID_BYTES = 128


def id_problem(name: str, value: str) -> str | None:
    """Why `value` is no valid id (a message naming `name`), or None."""
    size = len(value.encode())
    if not 1 <= size <= MAX_ID_BYTES or not value.isprintable():
        return f"{name} must be 1..{MAX_ID_BYTES} bytes of printable text, got {size} bytes"
    return None

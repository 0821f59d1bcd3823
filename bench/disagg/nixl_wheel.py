"""Slim nixl's wheel for the device call: drop its expert-parallel torch extensions.

Why: a device call carries at most 64 MiB, the working tree included (~3.4 MB). nixl-cu13 1.5.1
is 58.77 MB, of which 27 MB are `nixl_ep_*/nixl_ep_cpp_torch21{2,3,4}*.so`: NIXL's
expert-parallel add-on, built for torch 2.12-2.14. We never import it (contract/nixl_agent.py
uses the agent API), and the device's torch 2.11 could not load any of the three. Without them
the wheel (~31 MB) travels with .whl's (8.4 MB) in one call; a wheel carried in a call of its
own is lost whenever the next call lands on another machine (it did, 2026-12-05). The dropped
members leave RECORD too, so pip installs exactly what the slim wheel holds."""

from __future__ import annotations

import os
import re
import sys
import zipfile

_DROP = re.compile(r"^nixl_ep[^/]*/nixl_ep_cpp_torch\d+\.[^/]+\.so$")


def slim(path: str) -> tuple[int, int, int]:
    """Rewrite `path` without the dropped members; (size before, size after, members dropped)."""
    tmp, dropped = path + ".tmp", 0
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if _DROP.match(info.filename):
                dropped += 1
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if not _DROP.match(ln.split(",")[0])).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    before = os.path.getsize(path)
    os.replace(tmp, path)
    return before, os.path.getsize(path), dropped


if __name__ == "__main__":
    for wheel in sys.argv[1:]:
        before, after, dropped = slim(wheel)
        print(f"{wheel}: {before} -> {after} bytes, {dropped} members dropped")

"""Triton's CUDA tools (ptxas, cuobjdump, nvdisasm) as this process finds them, handed to a child
process so that it uses the same ones, and the reason when a process cannot run them.

Triton finds ptxas by running `<path> --version` for TRITON_PTXAS_PATH, then for the ptxas its
wheel carries, and says only "Cannot find ptxas" when none answers. Under compute-sanitizer
(--target-processes all) the KV service started by the churn test said exactly that while the
engine beside it compiled fine (issue 37). So the parent names the tools it resolved
(`child_env`: TRITON_*_PATH, absolute), and a process that starts on CUDA checks its own before
it compiles (`check`): a failure names the path, the exit status and what the tool printed.
Triton caches a failed answer for good (`NvidiaTool.from_path` is an lru_cache), so one
transient failure of `ptxas --version` would fail every later compile of the process: `check`
clears that cache and asks again before it gives up.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

log = logging.getLogger(__name__)

# Triton's knob name -> the environment variable it reads (triton.knobs.env_nvidia_tool).
TOOLS = {
    "ptxas": "TRITON_PTXAS_PATH",
    "ptxas_blackwell": "TRITON_PTXAS_BLACKWELL_PATH",
    "cuobjdump": "TRITON_CUOBJDUMP_PATH",
    "nvdisasm": "TRITON_NVDISASM_PATH",
}


class ToolchainError(RuntimeError):
    """Triton cannot run a CUDA tool it needs in this process."""


def child_env() -> dict[str, str]:
    """TRITON_*_PATH of every tool this process's Triton resolves, for a child's environment.
    Empty when this process has not imported Triton or runs it interpreted (no CUDA)."""
    triton = sys.modules.get("triton")
    if triton is None or os.environ.get("TRITON_INTERPRET") == "1":
        return {}
    out = {}
    for knob, key in TOOLS.items():
        try:
            out[key] = os.path.abspath(getattr(triton.knobs.nvidia, knob).path)
        except (AttributeError, RuntimeError):  # a tool this Triton does not have or find
            continue
    return out


def check(tries: int = 3, pause: float = 1.0) -> str:
    """The ptxas Triton uses here; ToolchainError naming why it cannot run one, after `tries`."""
    from triton import knobs

    said: list[str] = []
    for n in range(tries):
        try:
            path = knobs.nvidia.ptxas.path
        except RuntimeError as e:
            said = [str(e), *_attempts(knobs)]
            tool = getattr(knobs, "NvidiaTool", None)  # where Triton 3.6 to 3.9 keep it
            clear = getattr(getattr(tool, "from_path", None), "cache_clear", None)
            if clear is not None:
                clear()  # else the failed answer stays for the process's life
            if n + 1 < tries:
                time.sleep(pause)
            continue
        if said:
            log.warning("Triton found ptxas at try %d; before: %s", n + 1, "; ".join(said))
        return path
    raise ToolchainError("; ".join(said))


def _attempts(knobs) -> list[str]:
    """What each path Triton tries answers to `--version`."""
    knob = type(knobs.nvidia).__dict__.get("ptxas")
    bundled = getattr(knob, "default_path", None) or os.path.join(
        os.path.dirname(knobs.__file__), "backends", "nvidia", "bin", "ptxas"
    )
    paths = [p for p in (os.environ.get("TRITON_PTXAS_PATH"), bundled) if p]
    said = []
    for path in paths:
        try:
            r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
            out = (r.stdout + r.stderr).strip().replace("\n", " | ")[-400:]
            said.append(f"{path} --version exited {r.returncode}: {out}")
        except (OSError, subprocess.TimeoutExpired) as e:
            said.append(f"{path}: {type(e).__name__}: {e}")
    return said

"""Triton's CUDA tools (ptxas, cuobjdump, nvdisasm) as this process finds them, handed to a child
process so that it uses the same ones, and the reason when a process cannot run them.

Triton finds ptxas by running `<path> --version` for TRITON_PTXAS_PATH, then for the ptxas its
wheel carries, and says only "Cannot find ptxas" when none answers. Under compute-sanitizer
(--target-processes all) the KV service started by the churn test said exactly that while the
engine beside it compiled fine (issue 37). So the parent names the tools it resolved
(`child_env`: TRITON_*_PATH, absolute), and a process that starts on CUDA checks its own before
it compiles (`check`): a failure names the path, the exit status and what the tool printed.
"""

from __future__ import annotations

import os
import subprocess
import sys

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


def check() -> str:
    """The ptxas Triton uses here; ToolchainError naming why it cannot run one."""
    from triton import knobs

    try:
        return knobs.nvidia.ptxas.path
    except RuntimeError as e:
        raise ToolchainError(f"{e}: {'; '.join(_attempts(knobs))}") from e


def _attempts(knobs) -> list[str]:
    """What each path Triton tries answers to `--version`."""
    bundled = os.path.join(os.path.dirname(knobs.__file__), "backends", "nvidia", "bin", "ptxas")
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

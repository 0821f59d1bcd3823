"""Issue 28 defect 8: every kernel module sets Triton's interpreter switch before `import triton`.

Each kernel module is imported first (alone) in a fresh interpreter whose environment has no
TRITON_INTERPRET; on a machine without CUDA each must still load and launch under the interpreter.
The old order (`import triton` before `import kernels.interpreter`) fails here for swap_plan,
miss_copy and kv_append.
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(
    "kernels." + p.stem
    for p in (ROOT / "kernels").glob("*.py")
    if any(l.startswith(("import triton", "from triton")) for l in p.read_text().splitlines())
)


def test_every_triton_module_imports_the_switch_before_triton() -> None:
    for name in MODULES:
        lines = (ROOT / (name.replace(".", "/") + ".py")).read_text().splitlines()
        first_triton = next(
            i for i, l in enumerate(lines) if l.startswith(("import triton", "from triton"))
        )
        switch = [i for i, l in enumerate(lines) if l.startswith("import kernels.interpreter")]
        assert switch and switch[0] < first_triton, (
            f"{name}: import kernels.interpreter before triton"
        )

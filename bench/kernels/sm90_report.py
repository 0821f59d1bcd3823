"""Compile a Triton kernel for sm_90 on a machine without a GPU and report what the H200 would run:
registers, spill stack, shared memory, and the count of key SASS instructions (HGMMA = wgmma,
HMMA = mma.sync, LDGSTS = async copies, LDL/STL = spills, F2F = slow conversions, FFMA = fused
multiply-adds, which round once where separate products and sums round twice, FMUL.FTZ/FADD.FTZ =
fp32 math that flushes denormals, which PyTorch's kernels do not).

    from bench.kernels.sm90_report import compile_report
    compile_report(kernel, {"q_ptr": "*bf16", ...}, {"BLOCK": 64}, num_warps=8, num_stages=2)

Untyped arguments are i32. Pointers and integers are declared 16-divisible, as the launcher
specializes them on the device. Uses the ptxas and cuobjdump that Triton's wheel carries; the
numbers follow the local Triton version (install the device's, 3.6, beside it to match).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Triton reads these when kernels/ defines and compiles its kernels, not at `import triton`.
os.environ["TRITON_INTERPRET"] = "0"  # before kernels/ defines its kernels
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_OPS = (
    r"\b(HGMMA\.[0-9x]+|HMMA\.[0-9A-Z.]+|QGMMA\.[0-9x]+|LDGSTS|LDL[.0-9A-Z]*|STL[.0-9A-Z]*"
    r"|F2F\.[A-Z0-9.]+|FFMA|F(?:MUL|ADD)\.FTZ)"
)


def compile_report(fn, types: dict, constexprs: dict, **options) -> dict:
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = types.get(name, "i32")
        attrs[(i,)] = [["tt.divisibility", 16]]
    t0 = time.time()
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run(
            [f"{_BIN}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
        sass = subprocess.run(
            [f"{_BIN}/cuobjdump", "--dump-sass", f.name], capture_output=True, text=True
        ).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", res).groups()
    ops: dict[str, int] = {}
    for op in re.findall(_OPS, sass):
        ops[op] = ops.get(op, 0) + 1
    out = {"regs": int(regs), "stack": int(stack), "smem": k.metadata.shared, "ops": ops}
    print(f"{fn.__name__} {constexprs} {options}: {out} ({time.time() - t0:.1f}s)")
    return out

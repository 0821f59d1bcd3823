"""The default norm's and RoPE's kernels keep PyTorch's bits on the GPU only if their products
do not fuse into multiply-adds (one rounding instead of two) and keep denormals. Compiled here
for sm_90 (Triton's own ptxas, no GPU needed): no FFMA and no flushing FMUL/FADD in their SASS,
while the same RoPE kernel compiled with fusion allowed has FFMA, so the check can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

_SCRIPT = """
import json, sys
from bench.kernels.sm90_report import compile_report
from kernels.dense.rms_norm import _rms_scale_kernel, _rms_square_kernel
from kernels.dense.rope import _rope_kernel

bf16, f32 = "*bf16", "*fp32"
rope_types = {"x_ptr": bf16, "cos_ptr": f32, "sin_ptr": f32, "y_ptr": bf16}
rope = lambda inter, fusion: compile_report(
    _rope_kernel, rope_types,
    {"HALF": 32, "BLOCK_H": 16, "INTERLEAVED": inter, "UPCAST": False},
    num_warps=4, enable_fp_fusion=fusion,
)
norm = dict(num_warps=4, enable_fp_fusion=False)
out = {
    "rope_interleaved": rope(True, False),
    "rope_halves": rope(False, False),
    "rope_fused": rope(True, True),
    "square": compile_report(
        _rms_square_kernel, {"x_ptr": bf16, "sq_ptr": f32}, {"BLOCK": 1024}, **norm
    ),
    "scale": compile_report(
        _rms_scale_kernel, {"x_ptr": bf16, "r_ptr": f32, "w_ptr": bf16, "y_ptr": bf16},
        {"BLOCK": 1024, "UPCAST": False}, **norm,
    ),
}
sys.stdout.write("RESULT " + json.dumps(out) + "\\n")
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.exists(os.path.join(_BIN, "cuobjdump")), reason="Triton's ptxas/cuobjdump absent"
)
def test_norm_and_rope_kernels_have_no_fused_multiply_adds_on_sm90() -> None:
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT ") :])
    assert res["rope_fused"]["ops"].get("FFMA", 0) > 0  # the check sees fusion when allowed
    for name in ("rope_interleaved", "rope_halves", "square", "scale"):
        ops = res[name]["ops"]
        assert ops.get("FFMA", 0) == 0, (name, res[name])
        # PyTorch's kernels keep denormals: a flushing product would differ on tiny values.
        assert not any(op.endswith(".FTZ") for op in ops), (name, res[name])
        assert res[name]["stack"] == 0, (name, res[name])  # no spills

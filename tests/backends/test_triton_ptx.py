"""The row kernel's inline PTX (``FAST_MATH``, kernels module docstring) compiles for an
NVIDIA GPU, here without one: Triton's NVIDIA backend lowers the kernel to PTX and its bundled
``ptxas`` assembles it for sm_90. The GPU suite (tests/gpu) checks the results.

The compilation runs in a fresh process: the other Triton tests import the kernels under the
interpreter (``TRITON_INTERPRET=1``), which cannot compile them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# found, not imported: importing triton here, before the interpreter tests import their
# kernels under TRITON_INTERPRET=1, would fix its settings without the interpreter
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

_SCRIPT = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_ce_patch.backends.triton.kernels import logits_grad_inplace_kernel

names = ["z_ptr", "stride_z", "labels_ptr", "lse_ptr", "nll_ptr", "loss_ptr", "coef_ptr",
         "scale_ptr", "scale_value", "n_rows", "vocab", "softcap", "label_smoothing", "z_loss"]
types = ["*bf16", "i64", "*i64", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32", "fp32", "i32",
         "i32", "fp32", "fp32", "fp32"]
out = {}
for fast in (False, True):
    for softcap in (False, True):
        consts = dict(HAS_SOFTCAP=softcap, SMOOTHING=False, Z_LOSS=False, SCALE_MODE=0,
                      COMPUTE_LSE=True, WRITE_GRAD=True, BLOCK_V=1024, FIX_RNE=False,
                      NUM_STAGES=3, LANE_SUMS=True, PERSISTENT=False, SUB_ROWS=4,
                      FAST_MATH=fast)
        signature = dict(zip(names, types)) | {k: "constexpr" for k in consts}
        src = ASTSource(fn=logits_grad_inplace_kernel, signature=signature, constexprs=consts)
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": 4, "num_stages": 3})
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if "ptxas" in text.lower() or "backend" in text.lower():
                print(json.dumps({"skip": text[:300]}))
                sys.exit(0)
            raise
        ptx = k.asm["ptx"]
        out[f"{fast}-{softcap}"] = {"cubin": len(k.asm["cubin"]) > 0,
                                    "ex2": "ex2.approx.ftz.f32" in ptx,
                                    "rcp": "rcp.approx.ftz.f32" in ptx}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                         env.get("PYTHONPATH", "")])  # fmt: skip
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"cannot compile for sm_90 here: {result['skip']}")
    return result


@pytest.mark.parametrize("softcap", [False, True], ids=["plain", "softcap"])
@pytest.mark.parametrize("fast_math", [False, True], ids=["with-fixups", "fast"])
def test_row_kernel_ptx(compiled, fast_math, softcap):
    got = compiled[f"{fast_math}-{softcap}"]
    assert got["cubin"]  # ptxas accepted the inline assembly
    assert got["ex2"] == fast_math
    assert got["rcp"] == (fast_math and softcap)

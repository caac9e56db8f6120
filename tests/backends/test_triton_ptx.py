"""The row kernel's inline PTX (``FAST_MATH``, kernels module docstring) compiles for an
NVIDIA GPU, here without one: Triton's NVIDIA backend lowers the kernel to PTX and its bundled
``ptxas`` assembles it for sm_90. The GPU suite (tests/gpu) checks the results.

The compilation runs in a fresh process (tests/backends/aot.py): the other Triton tests import
the kernels under the interpreter (``TRITON_INTERPRET=1``), which cannot compile them. Only a
missing toolchain skips; ``ptxas`` rejecting the PTX fails.
"""

from __future__ import annotations

import importlib.util

import pytest

# found, not imported: importing triton here, before the interpreter tests import their
# kernels under TRITON_INTERPRET=1, would fix its settings without the interpreter
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import aot  # noqa: E402

_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_ce_patch.backends.triton.kernels import logits_grad_inplace_kernel

why = missing_toolchain(("cuda", 90, 32))
if why:
    print(json.dumps({"skip": why}))
    sys.exit(0)

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
        # no exception handling: ptxas rejecting the inline PTX is what this test catches
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 3})
        ptx = k.asm["ptx"]
        out[f"{fast}-{softcap}"] = {"cubin": len(k.asm["cubin"]) > 0,
                                    "ex2": "ex2.approx.ftz.f32" in ptx,
                                    "rcp": "rcp.approx.ftz.f32" in ptx}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def compiled():
    return aot.run(_SCRIPT)


@pytest.mark.parametrize("softcap", [False, True], ids=["plain", "softcap"])
@pytest.mark.parametrize("fast_math", [False, True], ids=["with-fixups", "fast"])
def test_row_kernel_ptx(compiled, fast_math, softcap):
    got = compiled[f"{fast_math}-{softcap}"]
    assert got["cubin"]  # ptxas accepted the inline assembly
    assert got["ex2"] == fast_math
    assert got["rcp"] == (fast_math and softcap)


_BAD_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def bad_ptx_kernel(x_ptr):
    x = tl.load(x_ptr)
    y = tl.inline_asm_elementwise("rcp.approx.ftz.f33 $0, $1;", "=f,f", [x],
                                  dtype=tl.float32, is_pure=True, pack=1)
    tl.store(x_ptr, y)
'''

_BAD_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bad_ptx_kernel import bad_ptx_kernel

why = missing_toolchain(("cuda", 90, 32))
if why:
    print(json.dumps({"skip": why}))
    sys.exit(0)
triton.compile(ASTSource(fn=bad_ptx_kernel, signature={"x_ptr": "*fp32"}),
               target=GPUTarget("cuda", 90, 32))
print(json.dumps({}))
"""


def test_rejected_ptx_fails_the_test(tmp_path):
    """A kernel whose inline PTX ``ptxas`` rejects fails the compile tests (it used to skip
    them, as if no toolchain were there)."""
    (tmp_path / "bad_ptx_kernel.py").write_text(_BAD_KERNEL)
    with pytest.raises(AssertionError, match="ptxas"):
        aot.run(_BAD_SCRIPT, path=tmp_path)


_COLS_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_ce_patch.backends.triton.kernels import logits_grad_cols_kernel

why = missing_toolchain(("cuda", 90, 32))
if why:
    print(json.dumps({"skip": why}))
    sys.exit(0)
names = ["z_ptr", "stride_z", "g_ptr", "stride_g", "b_ptr", "labels_ptr", "lse_ptr",
         "p_scale_ptr", "scale_ptr", "n_rows", "n_cols", "v0", "vocab", "softcap",
         "label_smoothing"]
types = ["*fp32", "i64", "*bf16", "i64", "*bf16", "*i64", "*fp32", "*fp32", "*fp32", "i32",
         "i32", "i32", "i32", "fp32", "fp32"]
out = {}
for softcap in (False, True):
    consts = dict(HAS_BIAS=True, HAS_SOFTCAP=softcap, SMOOTHING=True, BLOCK_R=2,
                  BLOCK_C=1024, FIX_RNE=False, FAST_MATH=True)
    signature = dict(zip(names, types)) | {k: "constexpr" for k in consts}
    k = triton.compile(ASTSource(fn=logits_grad_cols_kernel, signature=signature,
                                 constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    out[str(softcap)] = {"cubin": len(k.asm["cubin"]) > 0, "barrier": "bar.sync" in ptx,
                         "atomics": "atom." in ptx or "red." in ptx}
print(json.dumps(out))
'''


@pytest.mark.parametrize("softcap", [False, True], ids=["plain", "softcap"])
def test_in_place_gradient_kernel_keeps_its_barrier(softcap):
    """The zero-logits in-place backward's gradient kernel compiles for sm_90 with the
    barrier that orders every thread's loads of a block before the stores that overlay them
    (``g`` written over ``z``), and with no atomics."""
    got = aot.run(_COLS_SCRIPT)[str(softcap)]
    assert got["cubin"] and got["barrier"] and not got["atomics"]


_STATS_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_ce_patch.backends.triton.stats_kernels import token_stats_row_kernel

why = missing_toolchain(("cuda", 90, 32))
if why:
    print(json.dumps({"skip": why}))
    sys.exit(0)
names = ["z_ptr", "stride_z", "labels_ptr", "max_ptr", "log_s_ptr", "nll_ptr", "ent_ptr",
         "top1_ptr", "mean_ptr", "sq_ptr", "coef_ptr", "g_lp_ptr", "g_lp_value", "g_ent_ptr",
         "vocab", "logit_scale", "softcap", "temperature", "col0"]
types = ["*bf16", "i64", "*i64", "*fp32", "*fp32", "*fp32", "*fp32", "*i8", "*fp32", "*fp32",
         "*fp32", "*fp32", "fp32", "*fp32", "i32", "fp32", "fp32", "fp32", "i32"]
out = {}
for softcap, col_tile in ((False, False), (True, False), (False, True), (True, True)):
    # the CUDA launch (launch.stats_kernel_config): 2048 columns a step in 8 segments; SFT's
    # one launch, or the column-tiled backward's gradient pass (per-token weights, entropy)
    stats = not col_tile
    consts = dict(HAS_SOFTCAP=softcap, STATS=stats, ENTROPY=stats, TOP1=stats, MEAN=stats,
                  SQ=stats, GRAD=True, G_LP=2 if col_tile else 1, G_ENT=col_tile,
                  BLOCK_V=2048, FIX_RNE=False, NUM_STAGES=3, SUB_ROWS=8, FAST_MATH=True,
                  ENTROPY_IN_GRAD=stats, COL_TILE=col_tile)
    signature = dict(zip(names, types)) | {k: "constexpr" for k in consts}
    k = triton.compile(ASTSource(fn=token_stats_row_kernel, signature=signature,
                                 constexprs=consts),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 8 if softcap else 4, "num_stages": 3})
    ptx = k.asm["ptx"]
    out[f"{softcap}-{col_tile}"] = {"cubin": len(k.asm["cubin"]) > 0,
                                    "ex2": "ex2.approx.ftz.f32" in ptx,
                                    "rcp": "rcp.approx.ftz.f32" in ptx}
print(json.dumps(out))
'''


@pytest.mark.parametrize("col_tile", [False, True], ids=["sft", "col_tile"])
@pytest.mark.parametrize("softcap", [False, True], ids=["plain", "softcap"])
def test_token_stats_kernel_ptx(softcap, col_tile):
    """The per-token statistics row kernel compiles for sm_90 as CUDA launches it (every
    statistic, the gradient in the same launch; or the column-tiled backward's gradient
    pass), with the fast PTX ``exp`` (and reciprocal, with softcap)."""
    got = aot.run(_STATS_SCRIPT)[f"{softcap}-{col_tile}"]
    assert got["cubin"] and got["ex2"] and got["rcp"] == softcap

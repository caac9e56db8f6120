"""Tile sizes of backend ``"triton"``'s zero-logits kernels against the shared memory of the
GPUs they run on, without a GPU: Triton compiles the kernels ahead of time for a target
(``GPUTarget``) and reports the shared memory a launch needs (``metadata.shared``); a launch
whose need exceeds the device's opt-in limit raises ``OutOfResources``.

The 128 x 256 tiles chosen for an H200 need more than sm_86/sm_89 (99 KiB) or MI300
(64 KiB) give a block, so ``launch`` keeps 128 x 128 there.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import aot  # noqa: E402
from interpreted import import_kernels  # noqa: E402

import_kernels()  # the package's kernels stay interpreted for the other test modules
from fused_ce_patch.backends.triton import launch  # noqa: E402

KIB = 1024
#: (Triton target, opt-in shared memory per block in bytes: CUDA C programming guide's
#: compute-capability table; the LDS of MI300 and MI355)
TARGETS = {
    "sm90 (H100/H200)": (("cuda", 90, 32), 227 * KIB),
    "sm80 (A100)": (("cuda", 80, 32), 163 * KIB),
    "sm89 (L4/L40S/RTX 4090)": (("cuda", 89, 32), 99 * KIB),
    "gfx942 (MI300)": (("hip", "gfx942", 64), 64 * KIB),
    "gfx950 (MI355)": (("hip", "gfx950", 64), 160 * KIB),
}
CUDA0 = torch.device("cuda", 0)  # a device object only: no GPU is used


@pytest.mark.parametrize("limit", [227 * KIB, 163 * KIB, 99 * KIB, 64 * KIB])
def test_wide_tiles_only_where_the_shared_memory_allows(monkeypatch, limit):
    monkeypatch.setattr(launch, "max_shared_mem", lambda device: limit, raising=False)
    wide = limit >= 160 * KIB
    fwd = launch.forward_tile_config(torch.bfloat16, CUDA0)
    assert fwd.block_n == (256 if wide else 128)
    narrow_h = launch.backward_tile_config(torch.bfloat16, CUDA0, 640)
    assert narrow_h.block_n == (256 if wide else 128)
    assert launch.backward_tile_config(torch.bfloat16, CUDA0, 4096).block_n == 128
    for fn in (launch.forward_tile_config, launch.backward_tile_config):
        assert fn(torch.float32, CUDA0).block_n == 64  # float32 tiles never depend on it


# Compiled in a fresh process: once the interpreter tests have imported Triton under
# TRITON_INTERPRET=1, Triton's own library functions are interpreted ones and it cannot compile
# in that process (an assertion in triton.experimental.gluon); tests/backends/aot.py.
_SCRIPT = r"""
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_ce_patch.backends.triton import kernels, launch

triple, limit = json.loads(sys.argv[1])
why = missing_toolchain(triple)
if why:
    print(json.dumps({"skip": why}))
    sys.exit(0)
launch.max_shared_mem = lambda device: limit
cuda0 = torch.device("cuda", 0)  # a device object only: no GPU is used
common = dict(stride_hk=1, stride_wk=1, HAS_BIAS=False, HAS_SOFTCAP=False, SMOOTHING=False,
              EVEN_K=True, DOT_PRECISION="ieee", UPCAST=False, ROW_ALIGN=16, PERSISTENT=False)
types = dict(h_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", row_off_ptr="*i64",
             labels_ptr="*i64", part_ptr="*fp32", lse_ptr="*fp32", scale_ptr="*fp32",
             dh_acc_ptr="*fp32", dw_acc_ptr="*fp32", db_ptr="*fp32", softcap="fp32",
             scale_value="fp32", label_smoothing="fp32", z_loss="fp32")


def shared_bytes(fn, consts, tc):
    # 16-byte aligned pointers and sizes, unit inner strides, as real tensors specialise
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "i32")
            if sig[name].startswith("*") or name in ("stride_wv", "hidden_size", "vocab"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": tc.num_warps, "num_stages": tc.num_stages}
    return triton.compile(src, target=GPUTarget(*triple), options=opts).metadata.shared


fwd = launch.forward_tile_config(torch.bfloat16, cuda0)
launches = [("forward", kernels.lse_forward_kernel, fwd,
             dict(BLOCK_M=fwd.block_m, BLOCK_N=fwd.block_n, BLOCK_K=fwd.block_k))]
for hsize in (640, 4096):
    bwd = launch.backward_tile_config(torch.bfloat16, cuda0, hsize)
    launches.append((f"backward H={hsize}", kernels.dhidden_dweight_backward_kernel, bwd, dict(
        BLOCK_M=bwd.block_m, BLOCK_N=bwd.block_n, BLOCK_K=bwd.block_k, BLOCK_H=bwd.block_h,
        Z_LOSS=False, SCALE_MODE=1, NEED_H=True, NEED_W=True, NEED_B=False, FIX_RNE=False,
        FRESH_OPERANDS=False, ATOMIC_SEM="relaxed")))
out, seen = [], set()
for name, fn, tc, consts in launches:
    if (fn, tc) in seen:
        continue
    seen.add((fn, tc))
    # a compilation error (ptxas, an MLIR pass: RuntimeError) fails the test, never skips it
    out.append([name, str(tc), shared_bytes(fn, {**common, **consts}, tc)])
print(json.dumps({"launches": out}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_chosen_tiles_fit_the_shared_memory(target):
    """The tiles chosen for a device with this limit compile within it (bf16, H = 640, where
    the backward would take its widest tiles, and H = 4096)."""
    triple, limit = TARGETS[target]
    result = aot.run(_SCRIPT, json.dumps([triple, limit]))
    for name, tc, need in result["launches"]:
        assert need <= limit, f"{name} {tc}: needs {need} bytes of shared memory, {limit} given"

"""The ``ascend`` backend without kernels: the launch-configuration rule (Unified Buffer
budget, grids), chip detection, and how ``"auto"`` dispatches ``npu`` tensors (with simulated
``torch_npu`` / triton-ascend modules, since neither is installed in CI)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import itertools
import subprocess
import sys
import types
import warnings

import pytest
import torch

from fused_ce_patch.backends import registry
from fused_ce_patch.backends.ascend import AscendBackend
from fused_ce_patch.backends.ascend import chip as chip_mod
from fused_ce_patch.backends.ascend import config as cfg_mod
from fused_ce_patch.backends.ascend.chip import ChipSpec
from fused_ce_patch.errors import BackendUnavailableError

A2 = ChipSpec("Ascend910B2", 192 * 1024, aicores=24, vectorcores=48)
A3 = ChipSpec("Ascend910_9391", 192 * 1024, aicores=24, vectorcores=48)
A5 = ChipSpec("Ascend950PR", 256 * 1024, aicores=32, vectorcores=64, multibuffer=False)

VOCABS = (32000, 151936, 256000, 262144)
HIDDENS = (64, 896, 4096)
ROWS = (1, 47, 8192)
DTYPES = (torch.bfloat16, torch.float32)


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    for name in (chip_mod.ENV_UB_BITS, chip_mod.ENV_AICORES, chip_mod.ENV_VECTORCORES):
        monkeypatch.delenv(name, raising=False)


# -- the budget rule ------------------------------------------------------------------------


def _is_pow2(n):
    return n > 0 and n & (n - 1) == 0


def _check(cfg, n, h, v, dtype, chip):
    elem = cfg_mod.itemsize(dtype)
    budget = cfg_mod.ub_budget(chip)
    assert budget == int(chip.ub_bytes * cfg_mod.SAFETY)
    plans = {"rows": cfg.rows, "forward": cfg.forward, "backward": cfg.backward,
             "rowwise": cfg.rowwise}  # fmt: skip
    for name, plan in plans.items():
        assert plan.ub_bytes <= budget, (name, plan, budget)
    assert cfg.ub_bytes == max(p.ub_bytes for p in plans.values()) <= budget
    # the estimate is the (double-buffered) sum of the named live buffers
    mb = chip.multibuffer
    f, b, total = cfg.forward, cfg.backward, cfg_mod._total
    assert cfg.rows.ub_bytes == total(cfg_mod.row_kernel_buffers(cfg.rows.block, elem), mb)
    assert f.ub_bytes == total(cfg_mod.forward_tile_buffers(f.block_m, f.block_n, elem), mb)
    assert b.ub_bytes == cfg_mod._total(
        cfg_mod.backward_tile_buffers(b.block_m, b.block_n, b.block_h, elem), mb)
    # legal Triton blocks, 32-byte aligned vector blocks, 512-byte cube rows (or all of H)
    for blk in (cfg.rows.block, cfg.rowwise.block, f.block_m, f.block_n, f.block_k, b.block_m,
                b.block_n, b.block_k, b.block_h):  # fmt: skip
        assert _is_pow2(blk) and blk >= cfg_mod.MIN_BLOCK
    assert cfg.rows.block * elem % cfg_mod.UB_ALIGN == 0
    assert f.block_k * elem == cfg_mod.CUBE_K_BYTES or f.block_k >= h
    for p in (f, b):
        assert p.block_m * p.block_n * 4 <= cfg_mod.MAX_ACC_BYTES
        assert max(p.block_m, p.block_n) <= cfg_mod.MAX_TILE_SIDE
    # persistent grids: at most one program per core, never more programs than tasks
    assert 1 <= cfg.rows.grid <= min(chip.vectorcores, n)
    assert 1 <= cfg.rowwise.grid <= min(chip.vectorcores, n)
    assert 1 <= f.grid <= chip.aicores and 1 <= b.grid <= chip.aicores
    assert f.grid <= -(-n // f.block_m) * f.splits
    assert f.splits * f.block_n <= -(-v // f.block_n) * f.block_n
    # blocks no larger than the problem needs
    assert cfg.rows.block <= max(cfg_mod.MIN_BLOCK, 1 << (v - 1).bit_length())
    assert f.block_m <= max(cfg_mod.MIN_BLOCK, 1 << (n - 1).bit_length())


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("chip", [A2, A3, A5], ids=["A2", "A3", "950"])
def test_configuration_never_exceeds_the_ub_budget(chip, dtype):
    """Every kernel's live set fits the UB for V x H x N of issue 6, bf16 and fp32."""
    for v, h, n in itertools.product(VOCABS, HIDDENS, ROWS):
        cfg = cfg_mod.launch_config(n, h, v, dtype, chip)
        _check(cfg, n, h, v, dtype, chip)


def test_a2_numbers():
    """The configuration for Atlas A2 (192 KiB UB, double-buffered), as documented."""
    assert cfg_mod.ub_budget(A2) == 176947
    cfg = cfg_mod.launch_config(8192, 4096, 151936, torch.bfloat16, A2)
    assert cfg.rows.block == 2048 and cfg.rows.grid == 48
    assert (cfg.forward.block_m, cfg.forward.block_n, cfg.forward.block_k) == (32, 64, 256)
    assert (cfg.backward.block_m, cfg.backward.block_n, cfg.backward.block_h) == (32, 64, 64)
    assert cfg.forward.grid == cfg.backward.grid == 24 and cfg.forward.splits == 1
    one = cfg_mod.launch_config(1, 4096, 151936, torch.bfloat16, A2)
    assert one.forward.block_m == 16 and one.forward.splits == 24  # one row: split V over cores
    assert one.rows.grid == 1


def test_gpu_tuned_tiles_overflow_the_ub():
    """What the issue warns about: tiles tuned for a GPU exceed the A2 budget by this model."""
    budget = cfg_mod.ub_budget(A2)
    # the triton backend's CUDA bf16 tiles (128 x 128, H blocks of 64)
    assert cfg_mod._total(cfg_mod.forward_tile_buffers(128, 128, 2), True) > budget
    assert cfg_mod._total(cfg_mod.backward_tile_buffers(128, 128, 64, 2), True) > budget
    # a GPU cross-entropy row block (Liger's CUDA MAX_FUSED_SIZE)
    assert cfg_mod._total(cfg_mod.row_kernel_buffers(32768, 2), True) > budget


def test_no_double_buffering_or_a_bigger_ub_allows_bigger_blocks():
    a2 = cfg_mod.launch_config(8192, 4096, 151936, torch.bfloat16, A2)
    a5 = cfg_mod.launch_config(8192, 4096, 151936, torch.bfloat16, A5)
    assert a5.rows.block > a2.rows.block
    assert a5.backward.block_m * a5.backward.block_n >= a2.backward.block_m * a2.backward.block_n


def test_ub_override_shrinks_blocks(monkeypatch):
    monkeypatch.setenv(chip_mod.ENV_UB_BITS, str(1572864 // 4))
    small = chip_mod.detect_chip(torch.device("cpu"))
    assert small.ub_bytes == 1572864 // 32
    cfg = cfg_mod.launch_config(8192, 4096, 151936, torch.bfloat16, small)
    full = cfg_mod.launch_config(8192, 4096, 151936, torch.bfloat16, chip_mod.INTERPRETER)
    assert cfg.rows.block < full.rows.block
    _check(cfg, 8192, 4096, 151936, torch.bfloat16, small)


# -- chip detection -------------------------------------------------------------------------


def test_chip_facts_by_name():
    assert chip_mod.chip_facts("Ascend910B3") == (192 * 1024, True)
    assert chip_mod.chip_facts("Ascend910_9382") == (192 * 1024, True)
    assert chip_mod.chip_facts("Ascend910_9579") == (256 * 1024, False)
    assert chip_mod.chip_facts("Ascend950PR") == (256 * 1024, False)
    assert chip_mod.chip_facts("SomethingNew") == (chip_mod.DEFAULT_UB_BYTES, True)


def test_cpu_is_the_interpreter_chip_with_overrides(monkeypatch):
    assert chip_mod.detect_chip(torch.device("cpu")) == chip_mod.INTERPRETER
    monkeypatch.setenv(chip_mod.ENV_AICORES, "7")
    monkeypatch.setenv(chip_mod.ENV_VECTORCORES, "14")
    monkeypatch.setenv(chip_mod.ENV_UB_BITS, "1572864")
    spec = chip_mod.detect_chip(torch.device("cpu"))
    assert (spec.aicores, spec.vectorcores, spec.ub_bytes) == (7, 14, 196608)
    monkeypatch.setenv(chip_mod.ENV_AICORES, "zero")
    with pytest.raises(ValueError, match=chip_mod.ENV_AICORES):
        chip_mod.detect_chip(torch.device("cpu"))


class _NpuDevice:
    """Stands in for ``torch.device("npu", 0)``, which needs torch_npu to be spelled."""

    type = "npu"
    index = 0

    def __repr__(self):
        return "device(type='npu', index=0)"


def _fake_triton_ascend(monkeypatch, arch="Ascend910B4", aic=20, aiv=40):
    """Make ``triton.runtime.driver.active`` answer like triton-ascend's NPU driver."""
    import triton

    utils = types.SimpleNamespace(
        get_device_properties=lambda i: {"num_aicore": aic, "num_vectorcore": aiv})
    active = types.SimpleNamespace(
        utils=utils, get_current_target=lambda: types.SimpleNamespace(backend="npu", arch=arch))
    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=active))


def test_npu_chip_from_triton_ascend_driver(monkeypatch):
    _fake_triton_ascend(monkeypatch, arch="Ascend910B4", aic=20, aiv=40)
    monkeypatch.setattr(chip_mod, "_cache", {})
    spec = chip_mod.detect_chip(_NpuDevice())
    assert spec == ChipSpec("Ascend910B4", 192 * 1024, 20, 40, True)
    monkeypatch.setenv(chip_mod.ENV_VECTORCORES, "8")
    assert chip_mod.detect_chip(_NpuDevice()).vectorcores == 8


def test_npu_chip_defaults_without_a_driver(monkeypatch):
    """No triton-ascend driver answers: the name from torch.npu, the default core counts."""
    monkeypatch.setattr(chip_mod, "_cache", {})
    fake_npu = types.SimpleNamespace(get_device_name=lambda i: "Ascend950PR",
                                     current_device=lambda: 0)  # fmt: skip
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    spec = chip_mod.detect_chip(_NpuDevice())
    assert spec.name == "Ascend950PR" and spec.ub_bytes == 256 * 1024 and not spec.multibuffer
    assert (spec.aicores, spec.vectorcores) == (chip_mod.DEFAULT_AICORES,
                                                chip_mod.DEFAULT_VECTORCORES)


# -- dispatch -------------------------------------------------------------------------------


def _fake_torch_npu(monkeypatch):
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setattr(registry, "_warned", set())


def _resolve_recording(device, dtype=torch.bfloat16):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        backend = registry.resolve("auto", device, dtype)
    return backend, [w for w in seen if issubclass(w.category, RuntimeWarning)]


def test_auto_picks_ascend_for_npu_with_torch_npu_and_triton_ascend(monkeypatch, fresh_warnings):
    _fake_torch_npu(monkeypatch)
    import triton.backends

    monkeypatch.setitem(triton.backends.backends, "ascend", object())
    backend, seen = _resolve_recording(_NpuDevice())
    assert backend.name == "ascend" and not seen
    assert AscendBackend().availability() == (True, "")


def test_npu_without_torch_npu_falls_back_to_torch_warning_once(monkeypatch, fresh_warnings):
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    ok, why = AscendBackend().availability()
    assert not ok and "torch_npu" in why
    backend, seen = _resolve_recording(_NpuDevice())
    assert backend.name == "torch"
    assert len(seen) == 1
    msg = str(seen[0].message)
    assert "'ascend'" in msg and "torch_npu" in msg and "'torch'" in msg
    for _ in range(3):
        backend, seen = _resolve_recording(_NpuDevice())
        assert backend.name == "torch" and not seen


def test_npu_with_upstream_triton_falls_back_naming_triton_ascend(monkeypatch, fresh_warnings):
    """torch_npu present but the installed triton is upstream's (CUDA/ROCm backends only)."""
    _fake_torch_npu(monkeypatch)
    import triton.backends

    for name in ("ascend", "npu"):
        monkeypatch.delitem(triton.backends.backends, name, raising=False)
    backend, seen = _resolve_recording(_NpuDevice())
    assert backend.name == "torch" and len(seen) == 1
    assert "triton-ascend" in str(seen[0].message)


def test_explicit_ascend_that_cannot_run_raises(monkeypatch, fresh_warnings):
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(BackendUnavailableError, match="torch_npu"):
            registry.resolve("ascend", _NpuDevice(), torch.bfloat16)
    _fake_torch_npu(monkeypatch)
    import triton.backends

    monkeypatch.setitem(triton.backends.backends, "ascend", object())
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        registry.resolve("ascend", torch.device("cpu"), torch.float32)
    with pytest.raises(BackendUnavailableError, match="dtype"):
        registry.resolve("ascend", _NpuDevice(), torch.int64)


def test_interpreter_makes_ascend_explicit_only(monkeypatch, fresh_warnings):
    """Under TRITON_INTERPRET=1 "auto" never picks "ascend" for CPU tensors, even with the
    triton backend gone, and does not warn about it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delitem(registry._REGISTRY, "triton", raising=False)
    backend, seen = _resolve_recording(torch.device("cpu"), torch.float32)
    assert backend.name == "torch" and not seen
    assert registry.resolve("ascend", torch.device("cpu"), torch.float32).name == "ascend"


def test_real_npu_device_type_falls_back_once():
    """With the privateuse1 backend renamed to "npu" (what torch_npu does) a real
    ``torch.device("npu")`` goes to the torch backend with one warning; and importing the
    package imports neither torch_npu nor triton. (A fresh interpreter: the rename is
    process-wide and permanent.)"""
    code = """
import sys, warnings
import fused_ce_patch
from fused_ce_patch.backends import registry
assert "torch_npu" not in sys.modules and "triton" not in sys.modules, "heavy import"
import torch
torch.utils.rename_privateuse1_backend("npu")
dev = torch.device("npu", 0)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    names = [registry.resolve("auto", dev, torch.bfloat16).name for _ in range(3)]
msgs = [str(w.message) for w in seen if "ascend" in str(w.message)]
print(names, len(msgs))
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", registry.ENV_VAR)}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    if importlib.util.find_spec("torch_npu") is None:
        assert out.stdout.strip() == "['torch', 'torch', 'torch'] 1", out.stdout

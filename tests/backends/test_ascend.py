"""The ``ascend`` backend's kernels under the Triton interpreter (CPU tensors,
``TRITON_INTERPRET=1``, upstream Triton): the shared semantics suite on both paths at small
shapes, then what is specific to the backend (which path a budget selects, persistent programs
that loop over several rows and tiles, the launch configuration actually used).

This checks the arithmetic of the kernels and the host code, not triton-ascend's compiler:
nothing here has run on an Ascend NPU (docs/ascend.md). The launch-configuration rule, chip
detection and dispatch are tested in ``test_ascend_config.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from interpreted import import_kernels  # noqa: E402

import_kernels()  # before anything else imports the kernels
from fused_ce_patch.backends.ascend import launch  # noqa: E402
from fused_ce_patch.backends.triton import chunked_path, zero_logits  # noqa: E402
from fused_ce_patch.backends.triton import launch as triton_launch  # noqa: E402
from fused_ce_patch.backends.triton.launch import CUDA_LAUNCHERS  # noqa: E402

from semantics import *  # noqa: E402,F403  (collects the suite's test_* functions)
from semantics import TOL, Case, check_against_oracle, make  # noqa: E402

from fused_ce_patch import fused_linear_cross_entropy  # noqa: E402
from fused_ce_patch.backends import ascend as ascend_backend  # noqa: E402
from fused_ce_patch.backends.ascend import chip as chip_mod  # noqa: E402
from fused_ce_patch.backends.ascend import config as config_mod  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: A positive budget that cuts the suite's small shapes (V <= 97, float32) into several
#: chunks of at least 16 rows.
SMALL_BUDGET = 16 * 97 * 4

CASES = [
    Case("ascend", logits_budget=0, small=True, dtypes=DTYPES),  # zero-logits kernels
    Case("ascend", logits_budget=SMALL_BUDGET, small=True, dtypes=DTYPES),  # chunked path
]


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    """CPU tensors are accepted only under the interpreter; the interpreter's chip has few
    cores, so every persistent kernel loops."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(chip_mod.ENV_UB_BITS, raising=False)
    monkeypatch.delenv(chip_mod.ENV_AICORES, raising=False)
    monkeypatch.delenv(chip_mod.ENV_VECTORCORES, raising=False)


@pytest.fixture(params=CASES, ids=str)
def case(request, _interpreter):
    request.param.skip_if_unavailable()
    return request.param


# -- backend-specific -----------------------------------------------------------------------


def _spy_paths(monkeypatch):
    """Which shared driver each call runs with the ascend launchers (calls of backend
    "triton", which runs the same drivers with its CUDA launchers, are not counted)."""
    calls = []
    for label, fn in (
        ("chunked", chunked_path.TritonChunkedLinearCrossEntropy),
        ("zero", zero_logits.TritonZeroLogitsLinearCrossEntropy),
    ):
        original = fn.apply

        def spy(*args, _label=label, _orig=original):
            if isinstance(args[-1].launchers, launch.AscendLaunchers):
                calls.append(_label)
            return _orig(*args)

        monkeypatch.setattr(fn, "apply", spy)
    return calls


def test_budget_selects_the_path(monkeypatch):
    calls = _spy_paths(monkeypatch)
    case = Case("ascend")
    hidden, weight, labels, _ = make(case, (40,), 8, 50)
    v = weight.shape[0]
    for budget, want in (
        (None, "chunked"),
        (0, "zero"),
        (16 * v * 4, "chunked"),  # 16 whole rows fit
        (15 * v * 4, "zero"),  # fewer: the zero-logits path
    ):
        fused_linear_cross_entropy(hidden, weight, labels, backend="ascend", logits_budget=budget)
        assert calls[-1] == want, (budget, calls)


def test_auto_never_picks_ascend_for_cpu(monkeypatch):
    """Under the interpreter, "ascend" runs only when asked for by name."""
    calls = _spy_paths(monkeypatch)
    hidden, weight, labels, _ = make(Case("ascend"), (6,), 8, 17)
    fused_linear_cross_entropy(hidden, weight, labels)
    assert calls == []
    assert not ascend_backend.AscendBackend().auto


@pytest.mark.parametrize("budget", [0, SMALL_BUDGET], ids=["zero-logits", "chunked"])
def test_kernels_launch_with_the_configured_blocks_and_persistent_grids(monkeypatch, budget):
    """Every launch takes its blocks from launch_config and at most one program per core,
    with more rows / tiles than programs (so each program loops)."""
    grids = {}
    for name in ("logits_grad_inplace_kernel", "dhidden_rows_store_kernel",
                 "target_dweight_runs_kernel", "lse_forward_kernel",
                 "dhidden_dweight_backward_kernel"):  # fmt: skip
        # launched through the triton backend's argument builders, except the NPU-only one
        module = launch if name == "target_dweight_runs_kernel" else triton_launch
        kernel = getattr(module, name)

        class Recorder:
            def __init__(self, k=kernel, n=name):
                self.k, self.n = k, n

            def __getitem__(self, grid):
                def run(*args, **kw):
                    grids.setdefault(self.n, []).append((grid, kw))
                    return self.k[grid](*args, **kw)

                return run

        monkeypatch.setattr(module, name, Recorder())
    case = Case("ascend", logits_budget=budget)
    hidden, weight, labels, bias = make(case, (3, 11), 24, 97, bias=True, ignore_frac=0.1)
    loss = case.loss(hidden, weight, labels, bias=bias, reduction="none")
    torch.autograd.grad(loss.sum(), [hidden, weight, bias])

    spec = chip_mod.INTERPRETER
    cfg = config_mod.launch_config(int((labels != -100).sum()), 24, 97,
                                              torch.float32, spec)  # fmt: skip
    path = (["lse_forward_kernel", "dhidden_dweight_backward_kernel", "dhidden_rows_store_kernel"]
            if budget == 0 else ["logits_grad_inplace_kernel"])  # fmt: skip
    for name in path + ["target_dweight_runs_kernel"]:
        assert name in grids, (name, sorted(grids))
    for name, launches in grids.items():
        for grid, kw in launches:
            assert len(grid) == 1
            tiled = name in ("lse_forward_kernel", "dhidden_dweight_backward_kernel")
            assert grid[0] <= (spec.aicores if tiled else spec.vectorcores)
            if name == "logits_grad_inplace_kernel":
                assert kw["BLOCK_V"] == cfg.rows.block
            elif name == "lse_forward_kernel":
                assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"]) == (
                    cfg.forward.block_m, cfg.forward.block_n, cfg.forward.block_k)
            elif name == "dhidden_dweight_backward_kernel":
                assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_H"]) == (
                    cfg.backward.block_m, cfg.backward.block_n, cfg.backward.block_h)
            else:
                assert kw["BLOCK_H"] == cfg.rowwise.block
            assert "num_warps" not in kw and "num_stages" not in kw
            # one kernel source with the CUDA backend: the NPU's switches are what differ
            assert kw.get("PERSISTENT", True) is True
            assert kw.get("LANE_SUMS", False) is False and kw.get("FRESH_OPERANDS", True)


@pytest.mark.parametrize("budget", [0, SMALL_BUDGET], ids=["zero-logits", "chunked"])
def test_one_core_and_many_cores_agree(monkeypatch, oracle, budget):
    """The persistent loops give the same result with one program per kernel as with more
    programs than tasks (grids are capped by the task count)."""
    case = Case("ascend", logits_budget=budget)
    hidden, weight, labels, bias = make(case, (29,), 16, 67, bias=True)
    results = []
    for cores in ("1", "64"):
        monkeypatch.setenv(chip_mod.ENV_AICORES, cores)
        monkeypatch.setenv(chip_mod.ENV_VECTORCORES, cores)
        out = case.loss(hidden, weight, labels, bias=bias, reduction="none", softcap=3.0,
                        label_smoothing=0.1)  # fmt: skip
        results.append((out, *torch.autograd.grad(out.sum(), [hidden, weight, bias])))
        check_against_oracle(case, oracle, hidden, weight, labels, bias, reduction="sum",
                             softcap=3.0, label_smoothing=0.1)  # fmt: skip
    for a, b in zip(*results):
        assert oracle.rel_err(a, b) <= TOL[torch.float32]


def test_small_ub_forces_several_vocabulary_blocks(monkeypatch, oracle):
    """A UB so small that the row kernel's block covers a fraction of V, and the tile kernels
    take their smallest tiles: both paths still match the oracle."""
    monkeypatch.setenv(chip_mod.ENV_UB_BITS, str(8 * 4096))
    cfg = config_mod.launch_config(
        40, 24, 300, torch.float32, chip_mod.detect_chip(torch.device("cpu")))
    assert cfg.rows.block < 300 and cfg.rowwise.block < 24
    for budget in (0, 16 * 300 * 4):
        case = Case("ascend", logits_budget=budget)
        hidden, weight, labels, bias = make(case, (40,), 24, 300, bias=True)
        check_against_oracle(case, oracle, hidden, weight, labels, bias, reduction="mean",
                             softcap=4.0, z_loss=1e-3)  # fmt: skip


def test_bf16_zero_logits_matches_pytorch_precision(oracle):
    """bfloat16 on the zero-logits path (the interpreter's dot gets float32 operands rounded
    to bfloat16): no worse than PyTorch's own bf16 path."""
    case = Case("ascend", logits_budget=0)
    hidden, weight, labels, _ = make(case, (2, 9), 32, 61, dtype=torch.bfloat16, logit_std=3.0)
    res = {}
    for who, fn in (
        ("ours", lambda: case.loss(hidden, weight, labels)),
        ("ref", lambda: oracle.loss(hidden, weight, labels)),
        ("torch", lambda: torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(hidden, weight).float().flatten(0, 1),
            labels.reshape(-1))),  # fmt: skip
    ):
        out = fn()
        res[who] = (out, *torch.autograd.grad(out, [hidden, weight]))
    for i in range(3):
        e_ours = oracle.rel_err(res["ours"][i], res["ref"][i])
        e_torch = oracle.rel_err(res["torch"][i], res["ref"][i])
        assert e_ours <= 1.25 * e_torch + 1e-6, (i, e_ours, e_torch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_target_dweight_on_a_vocabulary_slice_as_the_cuda_launchers(dtype):
    """``target_dweight`` with ``[v_lo, v_hi)`` (how the zero-logits driver calls it for each
    vocabulary group of a 16-bit dW): only those labels, into a float32 accumulator of those
    rows; the same as the CUDA launchers' and as float64."""
    g = torch.Generator().manual_seed(0)
    m, h, v = 40, 24, 50
    labels = torch.randint(0, v, (m,), generator=g)
    coef = torch.randn(m, generator=g)
    hidden = torch.randn(m + 3, h, generator=g).to(dtype)
    rows = torch.randperm(m + 3, generator=g)[:m]
    row_off = rows * h
    chip = chip_mod.detect_chip(torch.device("cpu"))
    launchers = (launch.AscendLaunchers(config_mod.launch_config(m, h, v, dtype, chip)),
                 CUDA_LAUNCHERS)  # fmt: skip
    for v_lo, v_hi in ((0, 17), (17, 41), (41, 50)):
        start = torch.randn(v_hi - v_lo, h, generator=g)
        inside = (labels >= v_lo) & (labels < v_hi)
        products = coef[inside, None].double() * hidden[rows[inside]].double()
        want_w = start.double().index_add(0, labels[inside] - v_lo, products)
        want_b = torch.zeros(v, dtype=torch.float64).index_add(0, labels[inside],
                                                               coef[inside].double())  # fmt: skip
        for lau in launchers:
            dw, db = start.clone(), torch.zeros(v)
            lau.target_dweight(dw, db, labels, coef, hidden, row_off, v_lo=v_lo, v_hi=v_hi,
                               by_label=lau.sort_by_label(labels))  # fmt: skip
            torch.testing.assert_close(dw.double(), want_w, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(db.double(), want_b, rtol=1e-6, atol=1e-6)

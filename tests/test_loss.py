"""The public loss API (docs/design.md §2): signature, the module form, transformers' causal-LM
loss semantics, autocast, and the cost of validation. Numerical semantics per backend live in
``tests/backends/`` (the shared suite in ``semantics.py``)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_ce_patch
from fused_ce_patch import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from fused_ce_patch import loss as loss_mod
from fused_ce_patch.backends import registry

pytestmark = pytest.mark.usefixtures("seed", "one_thread")

TOL32 = 3e-5


def _inputs(lead=(3, 17), h=24, v=257, dtype=torch.float32, ignore=0.2):
    hidden = torch.randn(*lead, h, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h, dtype=dtype) / h**0.5).requires_grad_()
    labels = torch.randint(0, v, lead)
    labels[torch.rand(lead) < ignore] = -100
    return hidden, weight, labels


def test_public_signature():
    sig = inspect.signature(fused_linear_cross_entropy)
    names = list(sig.parameters)
    assert names[:3] == ["hidden", "weight", "labels"]
    defaults = {
        "bias": None,
        "ignore_index": -100,
        "reduction": "mean",
        "num_items_in_batch": None,
        "shift": False,
        "softcap": None,
        "label_smoothing": 0.0,
        "z_loss": 0.0,
        "logits_budget": None,
        "backend": "auto",
    }
    for name, default in defaults.items():
        p = sig.parameters[name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == default, name
    for name in ("fused_linear_cross_entropy", "FusedLinearCrossEntropyLoss"):
        assert name in fused_ce_patch.__all__


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_module_matches_function(backend, oracle):
    opts = dict(reduction="sum", shift=True, softcap=20.0, label_smoothing=0.05, z_loss=1e-3,
                ignore_index=-1, logits_budget=4096, backend=backend)  # fmt: skip
    hidden, weight, labels = _inputs()
    labels[labels == -100] = -1
    module = FusedLinearCrossEntropyLoss(**opts)
    for name in ("reduction", "shift", "softcap", "backend"):
        assert f"{name}={opts[name]!r}" in repr(module)
    bias = torch.randn(weight.shape[0])
    got = module(hidden, weight, labels, bias=bias, num_items_in_batch=torch.tensor(7))
    want = fused_linear_cross_entropy(hidden, weight, labels, bias=bias, num_items_in_batch=7,
                                      **opts)  # fmt: skip
    assert torch.equal(got, want)
    ref = oracle.loss(hidden, weight, labels, bias=bias, num_items_in_batch=7,
                      **{k: v for k, v in opts.items() if k not in ("logits_budget", "backend")})
    assert oracle.rel_err(got, ref) <= TOL32


# -- transformers' causal-LM loss -----------------------------------------------------------


@pytest.mark.parametrize("num_items", [None, 11, "tensor"])
def test_equals_transformers_for_causal_lm_loss(num_items, oracle):
    """``shift=True`` reproduces ``ForCausalLMLoss(logits, labels, ...)`` and ``shift=False``
    with transformers' ``shift_labels`` reproduces the already-shifted call."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    # float32: ForCausalLMLoss computes in float32 whatever the logits' dtype
    hidden, weight, labels = _inputs((2, 13), 16, 101)
    if num_items == "tensor":
        num_items = torch.tensor(int((labels[:, 1:] != -100).sum()) + 3)
    logits = hidden @ weight.t()
    want = ForCausalLMLoss(logits, labels, weight.shape[0], num_items_in_batch=num_items)
    for backend in ("torch", "reference"):
        got = fused_linear_cross_entropy(
            hidden, weight, labels, shift=True, num_items_in_batch=num_items, backend=backend
        )
        assert oracle.rel_err(got, want) <= TOL32
        g_got = torch.autograd.grad(got, [hidden, weight])
        g_want = torch.autograd.grad(want, [hidden, weight], retain_graph=True)
        for a, b in zip(g_got, g_want):
            assert oracle.rel_err(a, b) <= TOL32
    shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    want = ForCausalLMLoss(logits, None, weight.shape[0], num_items_in_batch=num_items,
                           shift_labels=shift_labels)  # fmt: skip
    got = fused_linear_cross_entropy(hidden, weight, shift_labels, num_items_in_batch=num_items)
    assert oracle.rel_err(got, want) <= TOL32


def test_num_items_in_batch_zero_gives_inf_as_stock():
    hidden, weight, labels = _inputs()
    for zero in (0, torch.tensor(0), torch.tensor(0.0)):
        got = fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=zero)
        assert got == torch.inf  # transformers' sum / num_items_in_batch


def test_int32_labels_and_a_single_position(oracle):
    hidden, weight, labels = _inputs()
    a = fused_linear_cross_entropy(hidden, weight, labels)
    b = fused_linear_cross_entropy(hidden, weight, labels.int())
    assert torch.equal(a, b)
    h1, y1 = hidden[0, 0], labels[0, 0].clamp(min=0)  # [H] and a 0-d label
    per = fused_linear_cross_entropy(h1, weight, y1, reduction="none")
    assert per.shape == ()
    assert oracle.rel_err(per, oracle.loss(h1, weight, y1, reduction="none")) <= TOL32


# -- autocast -------------------------------------------------------------------------------


class _RecordDtypes:
    def __init__(self, monkeypatch):
        self.seen = []
        backend = registry.get_backend("torch")
        original = backend.run

        def run(problem):
            self.seen.append((problem.hidden.dtype, problem.weight.dtype))
            return original(problem)

        monkeypatch.setattr(backend, "run", run)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_like_lm_head(monkeypatch, dtype):
    rec = _RecordDtypes(monkeypatch)
    hidden, weight, labels = _inputs()
    bias = torch.randn(weight.shape[0], requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        loss = fused_linear_cross_entropy(hidden, weight, labels, bias=bias, backend="torch")
        lm_head = torch.nn.functional.linear(hidden, weight, bias)
    assert rec.seen == [(dtype, dtype)] and lm_head.dtype == dtype
    assert loss.dtype == torch.float32
    loss.backward()
    assert hidden.grad.dtype == weight.grad.dtype == bias.grad.dtype == torch.float32
    # float64 is not an autocast type: left alone, as lm_head leaves it
    h64, w64 = hidden.detach().double(), weight.detach().double()
    with torch.autocast("cpu", dtype=dtype):
        assert fused_linear_cross_entropy(h64, w64, labels).dtype == torch.float64
    # outside autocast nothing is cast
    fused_linear_cross_entropy(hidden, weight, labels, backend="torch")
    assert rec.seen[-1] == (torch.float32, torch.float32)


# -- validation cost ------------------------------------------------------------------------


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ignored", [False, True])
def test_label_check_is_one_fused_reduction_and_one_sync(ignored):
    labels = torch.randint(0, 1000, (4096,))
    if ignored:
        labels[::3] = -100
    log = _OpLog()
    with log:
        rows, n = loss_mod._check_labels(labels, 1000, -100)
    assert n == int((labels != -100).sum()) and torch.equal(rows, (labels != -100).nonzero()[:, 0])
    reductions = [op for op in log.ops if op in ("aminmax", "amin", "amax", "min", "max", "any",
                                                   "all", "sum", "count_nonzero")]  # fmt: skip
    assert reductions == ["aminmax", "sum"], log.ops  # one min/max pass, one count
    assert "_local_scalar_dense" not in log.ops  # the one sync is a single .tolist()
    # the counted rows' indices without a second sync: nonzero_static, sized by the count
    assert "nonzero" not in log.ops, log.ops
    assert log.ops.count("nonzero_static") == (1 if ignored else 0), log.ops


def test_valid_labels_cost_no_extra_sync_per_chunk(monkeypatch):
    """The backend gets the counted rows and their number from validation: the chunk loop
    itself never reads a tensor back to the host."""
    hidden, weight, labels = _inputs((4, 64), 16, 509)
    log = _OpLog()
    with log:
        fused_linear_cross_entropy(hidden, weight, labels, logits_budget=16 * 509 * 4)
    assert "_local_scalar_dense" not in log.ops and log.ops.count("aminmax") == 1


def test_counted_rows_fall_back_to_nonzero_where_nonzero_static_is_missing(monkeypatch):
    """A device type without ``nonzero_static`` (some torch_npu builds) gets the same rows."""
    labels = torch.randint(0, 50, (301,))
    labels[::4] = -100

    def missing(*args, **kwargs):
        raise NotImplementedError("aten::nonzero_static: no kernel for this backend")

    monkeypatch.setattr(torch, "nonzero_static", missing)
    rows, n = loss_mod._check_labels(labels, 50, -100)
    assert n == int((labels != -100).sum())
    assert torch.equal(rows, (labels != -100).nonzero()[:, 0])

"""Stock semantics and clear errors at the edges of the public functions (issue 21).

- ``num_items_in_batch`` is ``sum / n`` for every value, as transformers computes it; values
  that are not real numbers are a ``TypeError`` naming the argument. (The full grid of values
  and gradients against stock runs on every backend: ``tests/backends/semantics.py``,
  ``test_num_items_in_batch_every_value_as_stock``.)
- ``torch.compile(fullgraph=True)`` with a Python ``num_items_in_batch`` that changes between
  calls (a SymInt after the first recompile) compiles and gives stock's numbers.
- labels of a dtype other than int64/int32, meta tensors and non-bool flags of
  ``fused_linear_token_stats`` raise clear errors naming the argument.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fused_ce_patch import (
    FusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy,
    fused_linear_token_stats,
    ops,
)
from fused_ce_patch.numerics import relative_error

pytestmark = pytest.mark.usefixtures("seed", "one_thread")

V, H = 53, 16
TOL32 = 1e-5


def _inputs(lead=(2, 7), dtype=torch.float32):
    hidden = torch.randn(*lead, H, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, lead)
    labels.view(-1)[3] = -100
    return hidden, weight, labels


def _stock(hidden, weight, labels, n):
    """transformers' ForCausalLMLoss on materialised logits (labels unshifted)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(hidden @ weight.t(), labels, V, num_items_in_batch=n)


# -- num_items_in_batch: types ---------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [True, 2 + 1j, "4", torch.tensor(True), torch.tensor(3 + 0j), np.bool_(True), [4]],
    ids=["bool", "complex", "str", "bool-tensor", "complex-tensor", "numpy-bool", "list"],
)
def test_num_items_that_is_not_real_is_a_type_error(bad):
    hidden, weight, labels = _inputs()
    with pytest.raises(TypeError, match="num_items_in_batch"):
        fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=bad)
    with pytest.raises(TypeError, match="num_items_in_batch"):
        FusedLinearCrossEntropyLoss()(hidden, weight, labels, num_items_in_batch=bad)


@pytest.mark.parametrize(
    "n", [7, 7.5, np.int64(7), np.float32(7.5), torch.tensor(7, dtype=torch.int16),
          torch.tensor([7.5], dtype=torch.float16)],
    ids=["int", "float", "numpy-int", "numpy-float", "int16-tensor", "float16-tensor[1]"])
def test_num_items_of_every_real_kind_divides_as_stock(n):
    hidden, weight, labels = _inputs()
    got = fused_linear_cross_entropy(hidden, weight, labels, shift=True, num_items_in_batch=n)
    # the documented result is 0-d float32 (stock's division would promote to a [1] or
    # float16 tensor for these divisors): compare with stock dividing by n in float32
    want = _stock(hidden, weight, labels, n.float() if isinstance(n, torch.Tensor) else n)
    assert got.shape == () and got.dtype == torch.float32
    assert relative_error(got, want.reshape(())) <= TOL32


def test_module_form_follows_stock_for_zero_and_nan():
    hidden, weight, labels = _inputs()
    loss_fn = FusedLinearCrossEntropyLoss(shift=True)
    assert loss_fn(hidden, weight, labels, num_items_in_batch=0) == math.inf
    out = loss_fn(hidden, weight, labels, num_items_in_batch=torch.tensor(math.nan))
    assert out.isnan()
    dh, dw = torch.autograd.grad(out, (hidden, weight))
    counted = torch.cat([labels[:, 1:], labels.new_full((2, 1), -100)], 1) != -100
    assert dh[counted].isnan().all() and (dh[~counted] == 0).all() and dw.isnan().all()


# -- torch.compile with a changing Python num_items_in_batch --------------------------------


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_full_graph_with_changing_python_num_items(backend):
    torch._dynamo.reset()
    hidden, weight, labels = _inputs()

    def fused(h, w, y, n):
        return fused_linear_cross_entropy(h, w, y, shift=True, num_items_in_batch=n,
                                          backend="torch")

    compiled = torch.compile(fused, fullgraph=True, backend=backend)
    stock_compiled = torch.compile(_stock, fullgraph=True, backend=backend)
    for n in (5, 7, 11, 0):  # the second call recompiles with n as a SymInt
        got = compiled(hidden, weight, labels, n)
        want = _stock(hidden, weight, labels, n)
        assert_same = relative_error(got, want) <= TOL32 if n else got == want == math.inf
        assert assert_same, (n, got, want)
        assert stock_compiled(hidden, weight, labels, n).item() == pytest.approx(want.item())
        if n:
            g_got = torch.autograd.grad(got * 1.5, (hidden, weight))
            g_want = torch.autograd.grad(want * 1.5, (hidden, weight))
            for a, b in zip(g_got, g_want):
                assert relative_error(a, b) <= 1e-4


def test_compile_with_changing_python_float_num_items(monkeypatch):
    torch._dynamo.reset()
    hidden, weight, labels = _inputs()
    seen = []
    original = ops._eager

    def spy(*args):
        seen.append(args[4:7])  # num_items_t, num_items_i, num_items_f
        return original(*args)

    monkeypatch.setattr(ops, "_eager", spy)
    compiled = torch.compile(
        lambda h, w, y, n: fused_linear_cross_entropy(h, w, y, shift=True,
                                                      num_items_in_batch=n, backend="torch"),
        fullgraph=True, backend="aot_eager")
    for n in (2.5, 6.25):  # a float is never truncated to an int on its way to the op
        got = compiled(hidden, weight, labels, n)
        assert relative_error(got, _stock(hidden, weight, labels, n)) <= TOL32
    assert [s[2] for s in seen] == [2.5, 6.25]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("n", [0, math.nan])
def test_compiled_zero_or_nan_num_items_gradient_is_stock(backend, n):
    """The compiled op forms the degenerate-divisor gradient inside a custom op kernel, where
    the dispatcher records no autograd graph; it must still be stock's inf/NaN pattern."""
    torch._dynamo.reset()
    hidden, weight, labels = _inputs()
    n = torch.tensor(n)

    def fused(h, w, y):
        return fused_linear_cross_entropy(h, w, y, shift=True, num_items_in_batch=n,
                                          backend="torch")

    got = torch.autograd.grad(torch.compile(fused, fullgraph=True, backend=backend)(
        hidden, weight, labels), (hidden, weight))
    want = torch.autograd.grad(_stock(hidden, weight, labels, n.float()), (hidden, weight))
    for a, b in zip(got, want):
        assert a.isnan().any() or a.isinf().any()
        torch.testing.assert_close(a, b, equal_nan=True)


# -- labels dtypes, meta tensors, flags ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.bool])
def test_labels_other_than_int64_int32_are_a_type_error(dtype):
    hidden, weight, labels = _inputs()
    bad = labels.clamp(min=0).to(dtype)
    with pytest.raises(TypeError, match="labels"):
        fused_linear_cross_entropy(hidden, weight, bad)
    with pytest.raises(TypeError, match="labels"):
        fused_linear_token_stats(hidden, weight, bad)


def test_int32_labels_accepted_by_both():
    hidden, weight, labels = _inputs()
    a = fused_linear_cross_entropy(hidden, weight, labels.int())
    b = F.cross_entropy((hidden @ weight.t()).reshape(-1, V), labels.reshape(-1))
    assert relative_error(a, b) <= TOL32
    stats = fused_linear_token_stats(hidden, weight, labels.int())
    assert stats.log_probs.shape == labels.shape


@pytest.mark.parametrize("which", ["hidden", "weight", "labels"])
def test_token_stats_meta_tensors_give_the_loss_error(which):
    hidden, weight, labels = _inputs()
    tensors = {"hidden": hidden.detach(), "weight": weight.detach(), "labels": labels}
    tensors[which] = tensors[which].to("meta")
    for fn in (fused_linear_cross_entropy, fused_linear_token_stats):
        with pytest.raises(ValueError, match=f"{which} is a meta tensor"):
            fn(tensors["hidden"], tensors["weight"], tensors["labels"])


@pytest.mark.parametrize("flag", ["entropy", "accuracy", "mean_logits", "log_sum_sq_probs"])
@pytest.mark.parametrize("value", ["no", 1, None, 0.0])
def test_token_stats_flags_must_be_bool(flag, value):
    hidden, weight, labels = _inputs()
    with pytest.raises(TypeError, match=flag):
        fused_linear_token_stats(hidden, weight, labels, **{flag: value})
    stats = fused_linear_token_stats(hidden, weight, labels, **{flag: False})
    assert getattr(stats, "is_top1" if flag == "accuracy" else flag) is None


def test_tensor_num_items_is_read_in_the_labels_one_sync():
    """The divisor joins the label statistics' single ``.tolist()``: no ``.item()`` of it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    hidden, weight, labels = _inputs()
    for n in (torch.tensor(7.25), torch.tensor(-3, dtype=torch.int32), torch.tensor(0.0)):
        with OpLog() as log:
            got = fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=n,
                                             backend="torch")
        assert "_local_scalar_dense" not in log.ops, log.ops
        total = fused_linear_cross_entropy(hidden, weight, labels, reduction="sum")
        expected = total / n.float()
        assert got == expected or relative_error(got, expected) <= TOL32

"""A patched model's logits loss (``chunked_causal_lm_loss``) is observationally identical to
transformers' ``ForCausalLMLoss``: values, NaN/inf, result shape and dtype, gradients and
exception types, for every input — and ``Trainer.evaluate`` reports stock's ``eval_loss``
with an all-ignored eval batch (stock's NaN for it is dropped by the Trainer).

Comparisons are against the live ``ForCausalLMLoss`` on the same tensors; NaN and ±inf must sit
at the same places, finite entries agree within the float32 tolerance (bf16 logits: 1e-2, one
rounding of the gradient to bf16 on either side).
"""

from __future__ import annotations

import math

import pytest
import torch

from fused_ce_patch import apply_fused_ce
from fused_ce_patch.hf import loss_mapping
from fused_ce_patch.hf.loss_mapping import chunked_causal_lm_loss
from hf_helpers import VOCAB, build_model, rel_err, shifted

V = 37


def stock(*args, **kwargs):
    return loss_mapping.original_causal_lm_loss()(*args, **kwargs)


def assert_same(a, b, tol, what):
    """Same shape and dtype; NaN and ±inf at the same places; finite entries within tol."""
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    a, b = a.detach().double(), b.detach().double()
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN differs\n{a}\n{b}"
    assert torch.equal(a.isposinf(), b.isposinf()), f"{what}: +inf differs"
    assert torch.equal(a.isneginf(), b.isneginf()), f"{what}: -inf differs"
    fin = b.isfinite()
    if fin.any() and b[fin].abs().max() > 0:
        assert rel_err(a[fin], b[fin]) <= tol, (what, rel_err(a[fin], b[fin]))
    else:
        assert (a[fin] == 0).all(), what


def _labels(shape=(3, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, shape, generator=g)
    labels[0, :3] = -100
    labels[-1, 5:] = -100
    return labels


def _compare(logits, labels, upstream=1.3, tol=None, **kwargs):
    tol = tol or (1e-2 if logits.dtype == torch.bfloat16 else 1e-5)
    want = stock(logits, labels, V, **kwargs)
    got = chunked_causal_lm_loss(logits, labels, V, **kwargs)
    assert_same(got, want, 1e-5, "loss")
    if logits.requires_grad and want.requires_grad:
        (gw,) = torch.autograd.grad(want, logits, torch.full_like(want, upstream))
        (gg,) = torch.autograd.grad(got, logits, torch.full_like(got, upstream))
        assert_same(gg, gw, tol, "grad")
    return got, want


NUM_ITEMS = {
    "none": None,
    "int": 11,
    "float": 7.5,
    "0": 0,
    "-0.0": -0.0,
    "-3": -3,
    "nan": math.nan,
    "inf": math.inf,
    "tensor-0": lambda: torch.tensor(0),
    "tensor-nan": lambda: torch.tensor(math.nan),
    "tensor-float64": lambda: torch.tensor(9.0, dtype=torch.float64),  # stock: float64 loss
    "tensor[1]": lambda: torch.tensor([9]),  # stock: a [1] loss
    "tensor-bool": lambda: torch.tensor(True),  # stock divides by 1
    "python-bool": True,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift", [False, True], ids=["labels", "shift_labels"])
@pytest.mark.parametrize("num", NUM_ITEMS)
def test_every_num_items_as_stock(dtype, shift, num, monkeypatch):
    monkeypatch.setattr(loss_mapping, "CHUNK_BYTES", 4 * V * 5)  # 5 rows a chunk: uneven
    torch.manual_seed(0)
    logits = (torch.randn(3, 8, V) * 3).to(dtype).requires_grad_()
    labels = _labels()
    kwargs = {}
    n = NUM_ITEMS[num]
    if n is not None:
        kwargs["num_items_in_batch"] = n() if callable(n) else n
    if shift:
        kwargs["shift_labels"] = shifted(labels)
        labels = None
    _compare(logits, labels, **kwargs)


@pytest.mark.parametrize("num", ["none", "0", "tensor-0", "int"])
def test_all_ignored_as_stock(num):
    logits = torch.randn(2, 5, V, requires_grad=True)
    labels = torch.full((2, 5), -100)
    n = NUM_ITEMS[num]
    kwargs = {} if n is None else {"num_items_in_batch": n() if callable(n) else n}
    got, want = _compare(logits, labels, **kwargs)
    assert got.isnan() == want.isnan()
    if num in ("none", "0", "tensor-0"):
        assert got.isnan()  # 0 / 0, as F.cross_entropy's mean gives


@pytest.mark.parametrize("upstream", [0.0, -2.0])
def test_gradient_at_zero_or_negative_upstream_with_zero_divisor(upstream):
    logits = torch.randn(2, 6, V, requires_grad=True)
    _compare(logits, _labels((2, 6)), upstream=upstream, num_items_in_batch=0)


@pytest.mark.parametrize("bad", [V, V + 5, -1, -7, -101])
def test_label_outside_vocab_raises_stock_type(bad):
    logits = torch.randn(2, 4, V)
    labels = torch.randint(0, V, (2, 4))
    labels[1, 2] = bad
    with pytest.raises(IndexError) as stock_err:
        stock(logits, labels, V)
    with pytest.raises(IndexError, match=f"label {bad} .*V = {V}"):
        chunked_causal_lm_loss(logits, labels, V)
    assert type(stock_err.value) is IndexError


def test_ignore_index_inside_the_vocabulary():
    logits = torch.randn(2, 6, V, requires_grad=True)
    labels = _labels((2, 6)).clamp(min=0)  # class 0 is the ignored one
    assert (labels == 0).any() and (labels != 0).any()
    _compare(logits, labels, ignore_index=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.float32])
def test_other_label_dtypes_behave_as_stock(dtype):
    """Not the chunked path's inputs: stock runs (int32 → its RuntimeError, uint8 → a value)."""
    logits = torch.randn(2, 6, V, requires_grad=True)
    labels = torch.randint(0, V, (2, 6)).to(dtype)
    try:
        stock(logits, labels, V)
    except Exception as err:  # noqa: BLE001 - the type is what is compared
        with pytest.raises(type(err)):
            chunked_causal_lm_loss(logits, labels, V)
        return
    _compare(logits, labels)


def test_non_real_num_items_behave_as_stock():
    logits = torch.randn(2, 6, V)
    labels = _labels((2, 6))
    with pytest.raises(TypeError):
        stock(logits, labels, V, num_items_in_batch="4")
    with pytest.raises(TypeError):
        chunked_causal_lm_loss(logits, labels, V, num_items_in_batch="4")
    got = chunked_causal_lm_loss(logits, labels, V, num_items_in_batch=2 + 0j)
    want = stock(logits, labels, V, num_items_in_batch=2 + 0j)
    assert got.dtype == want.dtype and torch.allclose(got, want)


def test_float64_logits_computed_in_float32_as_stock():
    logits = torch.randn(2, 6, V, dtype=torch.float64, requires_grad=True)
    got, want = _compare(logits, _labels((2, 6)))
    assert got.dtype == torch.float32


def test_noncontiguous_float32_logits_as_stock():
    base = torch.randn(6, 2, V)
    logits = base.transpose(0, 1)  # stock's .view(-1, V) refuses it: same error type
    with pytest.raises(RuntimeError):
        stock(logits, _labels((2, 6)), V)
    with pytest.raises(RuntimeError):
        chunked_causal_lm_loss(logits, _labels((2, 6)), V)


# -- Trainer.evaluate with an all-ignored eval batch -----------------------------------------


def _eval_loss(model, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(6):
        ids = torch.randint(0, VOCAB, (10,), generator=g)
        labels = ids.clone()
        if i in (2, 3):  # the second eval batch (size 2) has no counted label at all
            labels[:] = -100
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist(),
                     "attention_mask": [1] * 10})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2,
                             report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, eval_dataset=Dataset.from_list(rows))
    return trainer.evaluate()["eval_loss"]


def test_trainer_evaluate_all_ignored_batch_gives_stock_eval_loss(tmp_path, logits_loss_spy):
    pytest.importorskip("datasets")
    stock_model = build_model("llama")
    want = _eval_loss(stock_model, tmp_path / "stock")
    patched = apply_fused_ce(build_model("llama"))
    got = _eval_loss(patched, tmp_path / "patched")
    assert logits_loss_spy.count > 0  # the patched model's eval loss is the chunked one
    assert math.isfinite(want)
    assert got == pytest.approx(want, rel=1e-5)


# -- memory: no float32 copy of the logits -----------------------------------------------------


def test_no_float32_copy_of_the_logits_forward_or_backward(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Float32Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.largest = max(self.largest, t.numel())
            return out

    rows = 5
    monkeypatch.setattr(loss_mapping, "CHUNK_BYTES", 4 * V * rows)
    logits = torch.randn(4, 16, V).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (4, 16))
    for n in (None, 0):  # the ordinary path and the inf-scaled gradient
        spy = Float32Sizes()
        with spy:
            loss = chunked_causal_lm_loss(logits, labels, V, num_items_in_batch=n)
            torch.autograd.grad(loss, logits)
        assert 0 < spy.largest <= rows * V, (n, spy.largest)  # stock: 64 * V
    with Float32Sizes() as spy:
        torch.autograd.grad(stock(logits, labels, V), logits)
    assert spy.largest == 64 * V  # the copy this loss avoids (the spy can see it)

"""``fused_linear_jsd``'s float32 numerics and edge cases against the float64 reference of
tests/test_distill.py: log-probabilities formed as ``(z - max) - log(sum)`` so that a common
logit offset costs no accuracy; float32 products under CPU autocast; a float64 reciprocal of a
tensor ``num_items_in_batch`` for a float64 loss; an empty vocabulary refused by name. Found by
an adversarial pass (2026-12-05).
"""

from __future__ import annotations

import pytest
import torch

from fused_ce_patch import fused_linear_jsd
from test_distill import reference_jsd


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("shift", [1000.0, 20000.0])
def test_common_logit_offset_keeps_float32_accuracy(beta, shift):
    """Logits exactly representable in float32 and identity weights (an exact matmul): only
    the row arithmetic's rounding is measured; an offset leaves both distributions alone."""
    torch.manual_seed(0)
    n, v = 16, 64
    zs = torch.round(torch.randn(n, v, dtype=torch.float64) * 192) / 64 + shift
    zt = torch.round(torch.randn(n, v, dtype=torch.float64) * 192) / 64 + shift
    assert torch.equal(zs.float().double(), zs) and torch.equal(zt.float().double(), zt)
    eye = torch.eye(v)

    def run(fn, dtype):
        a = zs.to(dtype).requires_grad_()
        b = zt.to(dtype).requires_grad_()
        loss = fn(a, b)
        return (loss, *torch.autograd.grad(loss, [a, b]))

    fused = run(lambda a, b: fused_linear_jsd(a, eye, b, eye, beta=beta, reduction="sum"),
                torch.float32)
    exact = run(lambda a, b: reference_jsd(a, b, None, beta, 1.0, "sum"), torch.float64)
    for name, f, e in zip(["loss", "d/dzs", "d/dzt"], fused, exact):
        # float32 rounding of O(1) quantities over 64 columns (z - LSE rounded at the
        # offset's size gave 1e-4 .. 3e-3 here)
        assert _rel(f, e) <= 2e-6, f"{name}: {_rel(f, e):.1e}"


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_cpu_autocast_keeps_float32_products(beta):
    """bf16 operands under torch.autocast("cpu", bfloat16): the products are summed in
    float32 as without autocast (autocast had turned the float32 matmuls into bf16 ones)."""
    torch.manual_seed(0)
    hs = torch.randn(8, 32).bfloat16().requires_grad_()
    ws = (torch.randn(1003, 32) * 0.5).bfloat16().requires_grad_()
    ht, wt = torch.randn(8, 24).bfloat16(), (torch.randn(1003, 24) * 0.5).bfloat16()
    h64, w64 = hs.detach().double().requires_grad_(), ws.detach().double().requires_grad_()
    want = reference_jsd(h64 @ w64.t(), ht.double() @ wt.double().t(), None, beta, 1.0,
                         "batchmean")
    gh64, gw64 = torch.autograd.grad(want, [h64, w64])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_jsd(hs, ws, ht, wt, beta=beta)
    gh, gw = torch.autograd.grad(got, [hs, ws])
    # the loss: float32 rounding; the gradients: bf16 rounding of dz and dH / dW (2.5e-3
    # without autocast; 2e-2 .. 2e-1 when autocast reached the matmuls)
    assert _rel(got, want) < 1e-5, (got.item(), want.item())
    assert _rel(gh, gh64) < 5e-3 and _rel(gw, gw64) < 5e-3, (_rel(gh, gh64), _rel(gw, gw64))


def test_cpu_autocast_casts_float32_operands_as_lm_head_would():
    """float32 operands under bf16 autocast: each model's operands are taken in bf16, as its
    lm_head call would take them, then multiplied with float32 sums."""
    torch.manual_seed(1)
    hs, ws = torch.randn(6, 16), torch.randn(97, 16) * 0.5
    ht, wt = torch.randn(6, 8), torch.randn(97, 8) * 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_jsd(hs, ws, ht, wt, beta=0.5)
    want = fused_linear_jsd(hs.bfloat16(), ws.bfloat16(), ht.bfloat16(), wt.bfloat16(),
                            beta=0.5)
    assert torch.equal(got, want)


def test_tensor_num_items_keeps_float64_precision():
    torch.manual_seed(0)
    hs, ws = torch.randn(4, 6, dtype=torch.float64), torch.randn(11, 6, dtype=torch.float64)
    ht, wt = torch.randn(4, 7, dtype=torch.float64), torch.randn(11, 7, dtype=torch.float64)
    n = torch.tensor(3)
    want = reference_jsd(hs @ ws.t(), ht @ wt.t(), None, 0.5, 1.0, "batchmean", num_items=3)
    got = fused_linear_jsd(hs, ws, ht, wt, beta=0.5, num_items_in_batch=n)
    assert got.dtype == torch.float64
    assert abs(got.item() - want.item()) <= 1e-13 * abs(want.item()), (got.item(), want.item())


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
def test_empty_vocabulary_is_refused_by_name(reduction):
    hs, ht = torch.randn(2, 5, 6), torch.randn(2, 5, 7)
    ws, wt = torch.randn(0, 6), torch.randn(0, 7)
    with pytest.raises(ValueError, match="vocabulary is empty"):
        fused_linear_jsd(hs, ws, ht, wt, reduction=reduction)

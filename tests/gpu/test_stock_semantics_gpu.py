"""Stock semantics of ``num_items_in_batch`` and the logits loss on a CUDA GPU (marker ``gpu``).

The CPU suites check these against stock on every backend; here the same checks run with CUDA
tensors, where what differs is real: a divisor tensor on the device read in the labels' one
host sync (its float32 bits in the int64 statistics), backend ``triton``'s kernels under the
non-finite path, compile with a changing Python divisor, and the chunked logits loss raising
``IndexError`` for a bad label instead of stock's device-side assert.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from semantics import (  # noqa: E402,F401  (the imported tests are collected here)
    Case,
    test_all_ignored,
    test_num_items_in_batch_every_value_as_stock,
)

from fused_ce_patch import fused_linear_cross_entropy  # noqa: E402
from fused_ce_patch.numerics import relative_error  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = [
    Case("triton", logits_budget=0, device="cuda", dtypes=(torch.float32, torch.bfloat16)),
    Case("triton", logits_budget=None, device="cuda", dtypes=(torch.float32, torch.bfloat16)),
    Case("torch", device="cuda"),
]


@pytest.fixture(params=CASES, ids=str)
def case(request):
    request.param.skip_if_unavailable()
    return request.param


@pytest.fixture(autouse=True)
def _no_tf32():
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev


def _inputs():
    hidden = torch.randn(4, 33, 64, device="cuda", requires_grad=True)
    weight = torch.randn(1009, 64, device="cuda", requires_grad=True)
    labels = torch.randint(0, 1009, (4, 33), device="cuda")
    labels[0, :5] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("where", ["cuda", "cpu"])
@pytest.mark.parametrize("value", [7.25, -3.0, 0.0, math.nan, math.inf, 1e9 + 1])
def test_divisor_tensor_read_exactly(where, value):
    hidden, weight, labels = _inputs()
    n = torch.tensor(value, device=where)
    got = fused_linear_cross_entropy(hidden, weight, labels, shift=True, num_items_in_batch=n)
    total = fused_linear_cross_entropy(hidden, weight, labels, shift=True, reduction="sum")
    want = total / n.to("cuda").float()
    if math.isfinite(want.item()):
        assert relative_error(got, want) <= 1e-6
    else:
        assert (got.isnan() and want.isnan()) or got.item() == want.item()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_with_changing_python_divisor_on_cuda(backend):
    torch._dynamo.reset()
    hidden, weight, labels = _inputs()
    fn = torch.compile(
        lambda h, w, y, n: fused_linear_cross_entropy(h, w, y, shift=True, num_items_in_batch=n),
        fullgraph=True, backend=backend)
    for n in (5, 9, 13):
        got = fn(hidden, weight, labels, n)
        want = fused_linear_cross_entropy(hidden, weight, labels, shift=True, reduction="sum") / n
        assert relative_error(got, want) <= 1e-6


def test_logits_loss_bad_label_is_an_index_error_not_a_device_assert():
    from fused_ce_patch.hf.loss_mapping import chunked_causal_lm_loss

    logits = torch.randn(2, 8, 50, device="cuda", requires_grad=True)
    labels = torch.randint(0, 50, (2, 8), device="cuda")
    labels[1, 3] = 50
    with pytest.raises(IndexError, match="label 50"):
        chunked_causal_lm_loss(logits, labels, 50)
    # the CUDA context is intact: an ordinary call still works
    labels[1, 3] = 7
    loss = chunked_causal_lm_loss(logits, labels, 50, num_items_in_batch=torch.tensor(0).cuda())
    assert loss.item() == math.inf
    (g,) = torch.autograd.grad(loss, logits)
    assert g.isnan().any() and torch.cuda.synchronize() is None

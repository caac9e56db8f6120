"""fused_head_loss in one process: plain heads are read directly, hooks of unknown purpose are
refused (they would be bypassed), and the head's forward is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fused_ce_patch.errors import UnsupportedModelError
from fused_ce_patch.hf.head import fused_head_loss


def _data(v=37, h=8, n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(h, v, bias=True, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g, dtype=torch.float64))
        head.bias.copy_(torch.randn(v, generator=g, dtype=torch.float64))
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[3] = -100
    return head, hidden, labels


def test_plain_head_equals_functional_with_scale():
    head, hidden, labels = _data()
    loss, vocab = fused_head_loss(head, hidden, labels, logit_scale=0.5, backend="torch")
    loss.backward()
    got = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    for t in (hidden, head.weight, head.bias):
        t.grad = None
    ref = torch.nn.functional.cross_entropy(head(hidden) * 0.5, labels, ignore_index=-100)
    ref.backward()
    assert vocab == 37
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for a, b in zip(got, (hidden.grad, head.weight.grad, head.bias.grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert "forward" not in head.__dict__


@pytest.mark.parametrize("kind", ["pre", "post"])
def test_user_hook_is_refused(kind):
    head, hidden, labels = _data()
    if kind == "pre":
        head.register_forward_pre_hook(lambda m, a: (a[0] * 2,))
    else:
        head.register_forward_hook(lambda m, a, out: out / 2)
    with pytest.raises(UnsupportedModelError, match="forward hooks"):
        fused_head_loss(head, hidden, labels)


def test_flat_placeholder_is_refused():
    head, hidden, labels = _data()
    head.weight = nn.Parameter(torch.empty(0, dtype=torch.float64))  # what a flat shard looks like
    with pytest.raises(UnsupportedModelError, match="shard or flat placeholder"):
        fused_head_loss(head, hidden, labels)

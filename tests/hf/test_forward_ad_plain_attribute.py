"""Forward-mode AD with the tangent on ``lm_head.weight`` or ``.bias`` set as a plain tensor
attribute, the PyTorch forward-AD tutorial's way (``delattr(m, name); setattr(m, name,
fwAD.make_dual(p, t))``): the patched model steps aside to stock and gives stock's JVP. Found or
checked by an adversarial pass (2026-12-05).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from fused_ce_patch import apply_fused_ce
from hf_helpers import batch, build_model, reference_copy


def _jvp(model, pname):
    g = torch.Generator().manual_seed(3)
    with fwAD.dual_level():
        p = getattr(model.lm_head, pname).detach()
        delattr(model.lm_head, pname)
        setattr(model.lm_head, pname, fwAD.make_dual(p, torch.randn(p.shape, generator=g)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model(**batch())
        primal, tangent = fwAD.unpack_dual(out.loss)
        return primal.item(), tangent.item()


@pytest.mark.parametrize("pname", ["weight", "bias"])
def test_dual_head_tensor_attribute_gives_stock_jvp(pname):
    model = build_model("llama")
    if pname == "bias":
        torch.manual_seed(4)
        model.lm_head = torch.nn.Linear(32, model.config.vocab_size, bias=True)
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    want = _jvp(ref, pname)
    got = _jvp(model, pname)
    assert got == pytest.approx(want, rel=1e-5)

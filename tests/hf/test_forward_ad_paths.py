"""Forward-mode AD (torch.autograd.forward_ad.dual_level) through a patched model gives the
stock JVP: the patched forward steps aside to stock whenever a tangent reaches its loss, also
where it enters other than as ``lm_head.weight`` (a parametrization's ``original``, a LoRA
adapter's weights, ``num_items_in_batch``); the fused autograd Functions have no ``jvp``.
Found by an adversarial pass (2026-12-05): those three raised or dropped the tangent.
"""

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.utils.parametrize as P
from torch.func import functional_call

from fused_ce_patch import apply_fused_ce
from hf_helpers import batch, build_model, reference_copy


def _jvp(model, names):
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(3)
    with fwAD.dual_level():
        new = {n: fwAD.make_dual(params[n].detach(), torch.randn(params[n].shape, generator=g))
               for n in names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = functional_call(model, new, (), batch())
        primal, tangent = fwAD.unpack_dual(out.loss)
        return primal.item(), tangent.item()


class _Ident(torch.nn.Module):
    def forward(self, w):
        return w * 1.0


def test_forward_ad_through_parametrized_head():
    model = build_model("llama")
    ref = reference_copy(model)
    P.register_parametrization(ref.lm_head, "weight", _Ident())
    apply_fused_ce(model, backend="torch")
    P.register_parametrization(model.lm_head, "weight", _Ident())
    names = ["lm_head.parametrizations.weight.original"]
    want = _jvp(ref, names)
    got = _jvp(model, names)
    assert got == pytest.approx(want, rel=1e-5)


def test_forward_ad_through_lora_head():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_model("llama"), peft.LoraConfig(
        r=4, target_modules=["lm_head", "q_proj"], lora_dropout=0.0, init_lora_weights=False))
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    names = [n for n, _ in model.named_parameters() if "lm_head.lora_A" in n]
    want = _jvp(ref, names)
    got = _jvp(model, names)
    assert got == pytest.approx(want, rel=1e-5)


def test_forward_ad_tangent_on_num_items_in_batch():
    """A dual ``num_items_in_batch``: stock's loss (sum / n) carries the tangent -loss/n
    times n's tangent; the patched model gives it too (it was dropped silently)."""
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")

    def run(m):
        with fwAD.dual_level():
            n = fwAD.make_dual(torch.tensor(20.0), torch.tensor(1.0))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = m(**batch(), num_items_in_batch=n)
            primal, tangent = fwAD.unpack_dual(out.loss)
            return primal.item(), None if tangent is None else tangent.item()

    want = run(ref)
    got = run(model)
    assert got[1] is not None and got == pytest.approx(want, rel=1e-5)


def test_functional_refuses_a_num_items_tangent():
    """The functional cannot carry that tangent: it says so rather than drop it."""
    from fused_ce_patch import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 8, generator=g), torch.randn(11, 8, generator=g)
    y = torch.randint(0, 11, (6,), generator=g)
    with fwAD.dual_level():
        n = fwAD.make_dual(torch.tensor(5.0), torch.tensor(1.0))
        with pytest.raises(ValueError, match="forward-mode AD tangent"):
            fused_linear_cross_entropy(h, w, y, num_items_in_batch=n)
        plain = fused_linear_cross_entropy(h, w, y, num_items_in_batch=fwAD.unpack_dual(n).primal)
    assert torch.isfinite(plain)

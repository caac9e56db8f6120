"""Forward-mode AD with the tangent on a LoRA head's ``lora_B`` or ``lora_A`` weight set as a plain
tensor attribute (the forward-AD tutorial's delattr/setattr): the patched model sees the dual
among the head's stored tensors, steps aside, and gives stock's JVP. Found by an adversarial
pass (2026-12-05).
"""

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from fused_ce_patch import apply_fused_ce
from hf_helpers import batch, build_model, reference_copy

peft = pytest.importorskip("peft")


def _jvp(model, which):
    layer = getattr(model.get_output_embeddings(), which)["default"]
    g = torch.Generator().manual_seed(3)
    with fwAD.dual_level():
        p = layer.weight.detach()
        delattr(layer, "weight")
        layer.weight = fwAD.make_dual(p, torch.randn(p.shape, generator=g))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model(**batch())
        primal, tangent = fwAD.unpack_dual(out.loss)
        return primal.item(), tangent.item()


@pytest.mark.parametrize("which", ["lora_B", "lora_A"])
def test_dual_lora_weight_attribute_gives_stock_jvp(which):
    model = peft.get_peft_model(build_model("llama"), peft.LoraConfig(
        r=4, target_modules=["lm_head"], lora_dropout=0.0, init_lora_weights=False))
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    want = _jvp(ref, which)
    got = _jvp(model, which)
    assert got == pytest.approx(want, rel=1e-5)

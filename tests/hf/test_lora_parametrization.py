"""A torch parametrization on a LoRA head's ``lora_B`` weight is evaluated once per patched
forward, as in stock PEFT's ``lora_B(...)`` call (the head checks read the stored tensor): a
counting one counts 1, a random one gives stock's loss. Found by an adversarial pass
(2026-12-05).
"""

import copy
import warnings

import pytest
import torch
import torch.nn.utils.parametrize as P

from fused_ce_patch import apply_fused_ce
from hf_helpers import CountingParametrization as _Count
from hf_helpers import DropoutParametrization, batch, build_model, reference_copy

peft = pytest.importorskip("peft")


def _Dropout():
    return DropoutParametrization(0.5)


def _pair(parametrization):
    model = peft.get_peft_model(build_model("llama"), peft.LoraConfig(
        r=4, target_modules=["lm_head"], lora_dropout=0.0, init_lora_weights=False))
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, ref):
        P.register_parametrization(m.get_output_embeddings().lora_B["default"], "weight",
                                   copy.deepcopy(parametrization))
    return model, ref


def _loss(m):
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return m(**batch()).loss.item()


def test_lora_b_parametrization_evaluated_once():
    model, ref = _pair(_Count())
    counts = {}
    for name, m in (("patched", model), ("stock", ref)):
        p = m.get_output_embeddings().lora_B["default"].parametrizations.weight[0]
        p.n = 0
        _loss(m)
        counts[name] = p.n
    assert counts == {"patched": 1, "stock": 1}


def test_lora_b_random_parametrization_gives_stock_loss():
    model, ref = _pair(_Dropout())
    want, got = _loss(ref), _loss(model)
    assert got == pytest.approx(want, rel=1e-5), (got, want)

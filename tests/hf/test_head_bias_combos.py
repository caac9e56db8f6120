"""The head bias is read once, in stock's order (weight, then bias), in combinations: weight and
bias both parametrized on a plain head (counting and random), LoRA over a base with a
parametrized bias, a bias that is a plain tensor attribute, bias=None. Found or checked by an
adversarial pass (2026-12-05).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.utils.parametrize as P

from fused_ce_patch import apply_fused_ce
from hf_helpers import batch, build_model, reference_copy
from hf_helpers import CountingParametrization as _Count, DropoutParametrization as _Dropout


def _pair(bias=True, peft_lora=False):
    model = build_model("llama")
    torch.manual_seed(3)
    head = torch.nn.Linear(32, model.config.vocab_size, bias=bias)
    if bias:
        with torch.no_grad():
            head.bias.normal_(0, 2.0)
    model.lm_head = head
    if peft_lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, target_modules=["lm_head"], lora_dropout=0.0, init_lora_weights=False))
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    return model, ref


def _step(model, seed=7):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(**batch()).loss
    loss.backward()
    after = torch.rand(3)  # the RNG stream after the step
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), after, grads


def _lm_head(m):
    head = m.get_output_embeddings()
    return head.get_base_layer() if hasattr(head, "get_base_layer") else head


@pytest.mark.parametrize("peft_lora", [False, True])
def test_weight_and_bias_parametrized_counts(peft_lora):
    if peft_lora:
        pytest.importorskip("peft")
    model, ref = _pair(peft_lora=peft_lora)
    counts = {}
    for name, m in (("patched", model), ("stock", ref)):
        head = _lm_head(m)
        names = ("bias",) if peft_lora else ("weight", "bias")
        for pname in names:
            P.register_parametrization(head, pname, _Count())
            head.parametrizations[pname][0].n = 0
        _step(m)
        counts[name] = tuple(head.parametrizations[p][0].n for p in names)
    assert counts["patched"] == counts["stock"], counts


@pytest.mark.parametrize("peft_lora", [False, True])
def test_weight_and_bias_random_parametrizations(peft_lora):
    if peft_lora:
        pytest.importorskip("peft")
    model, ref = _pair(peft_lora=peft_lora)
    for m in (model, ref):
        head = _lm_head(m)
        for pname in (("bias",) if peft_lora else ("weight", "bias")):
            P.register_parametrization(head, pname, _Dropout())
    want, got = _step(ref), _step(model)
    assert got[0] == pytest.approx(want[0], rel=1e-5), (got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_bias_plain_tensor_attribute():
    model, ref = _pair()
    for m in (model, ref):
        b = m.lm_head.bias.detach().clone()
        del m.lm_head.bias
        m.lm_head.bias = b  # not a Parameter: no gradient, a plain tensor
    want, got = _step(ref), _step(model)
    assert got[0] == pytest.approx(want[0], rel=1e-5), (got[0], want[0])


def test_bias_none():
    model, ref = _pair(bias=False)
    want, got = _step(ref), _step(model)
    assert got[0] == pytest.approx(want[0], rel=1e-5), (got[0], want[0])

"""A parametrized head weight is evaluated once per forward, as in stock's one head call, also
where it sits inside the head (a PEFT ``lora.Linear`` whose ``.weight`` property reads the base
layer's) and where the forward reads ``logits.device`` (the CrossEntropyLoss form's
``labels.to(logits.device)``, BartForCausalLM): a random parametrization gives stock's loss.
Found or checked by an adversarial pass (2026-12-05).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.utils.parametrize as P
import transformers

from fused_ce_patch import apply_fused_ce
from fused_ce_patch.hf.tiny import tiny_config
from hf_helpers import batch, build_model, reference_copy
from hf_helpers import CountingParametrization as _Count, DropoutParametrization as _Dropout


def _loss(model, b):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(**b).loss
    loss.backward()
    return loss.item()


# -- PEFT LoRA over a parametrized base weight (float32 llama) --------------------------------

def _lora_pair(parametrization):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_model("llama"), peft.LoraConfig(
        r=4, target_modules=["lm_head"], lora_dropout=0.0, init_lora_weights=False))
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, ref):
        P.register_parametrization(m.get_output_embeddings().get_base_layer(), "weight",
                                   copy.deepcopy(parametrization))
    return model, ref


def test_lora_parametrized_base_weight_evaluated_once():
    model, ref = _lora_pair(_Count())
    counts = {}
    for name, m in (("patched", model), ("stock", ref)):
        p = m.get_output_embeddings().get_base_layer().parametrizations.weight[0]
        p.n = 0
        _loss(m, batch())
        counts[name] = p.n
    assert counts == {"patched": 1, "stock": 1}


def test_lora_random_base_weight_parametrization_gives_stock_loss():
    model, ref = _lora_pair(_Dropout())
    want, got = _loss(ref, batch()), _loss(model, batch())
    assert got == pytest.approx(want, rel=1e-5), (got, want)


# -- the CrossEntropyLoss form (BartForCausalLM: labels.to(logits.device)) ---------------------

def _bart_pair(parametrization):
    config = tiny_config("bart")
    for k in ("encoder_attention_heads", "decoder_attention_heads"):
        setattr(config, k, 4)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = transformers.BartForCausalLM(config).double().train()
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, stock):
        P.register_parametrization(m.lm_head, "weight", copy.deepcopy(parametrization))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, config.vocab_size, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return model, stock, {"input_ids": ids, "labels": labels}


def test_bart_parametrized_head_weight_evaluated_once():
    model, stock, b = _bart_pair(_Count())
    counts = {}
    for name, m in (("patched", model), ("stock", stock)):
        m.lm_head.parametrizations.weight[0].n = 0
        _loss(m, b)
        counts[name] = m.lm_head.parametrizations.weight[0].n
    assert counts == {"patched": 1, "stock": 1}


def test_bart_random_head_weight_parametrization_gives_stock_loss():
    model, stock, b = _bart_pair(_Dropout())
    want, got = _loss(stock, b), _loss(model, b)
    assert got == pytest.approx(want, rel=1e-9), (got, want)

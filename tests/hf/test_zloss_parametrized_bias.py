"""Bamba's z-loss (an extra term reading ``logits.logsumexp(dim=-1)``) with a head whose bias is
parametrized: the loss and the term see one evaluation of it, as stock's one head call (the
fused log-sum-exp refuses such a head, so the logits are materialised before the loss). Found or
checked by an adversarial pass (2026-12-05).
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
from hf_helpers import CountingParametrization as _Count, DropoutParametrization as _Dropout
from hf_helpers import short_batch as _batch


def _pair(parametrization):
    config = tiny_config("bamba")
    config.z_loss_coefficient = 0.25
    torch.manual_seed(0)
    model = transformers.BambaForCausalLM(config).double().train()
    torch.manual_seed(3)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True).double()
    with torch.no_grad():
        head.bias.normal_(0, 3.0)
    model.lm_head = head
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, stock):
        P.register_parametrization(m.lm_head, "bias", copy.deepcopy(parametrization))
    return model, stock


def _loss(model, batch):
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(**batch).loss


def test_zloss_bias_parametrization_evaluated_once_as_stock():
    model, stock = _pair(_Count())
    b = _batch(model.config.vocab_size)
    counts = {}
    for name, m in (("patched", model), ("stock", stock)):
        m.lm_head.parametrizations.bias[0].n = 0
        _loss(m, b)
        counts[name] = m.lm_head.parametrizations.bias[0].n
    assert counts == {"patched": 1, "stock": 1}


def test_zloss_random_bias_parametrization_gives_stock_loss():
    model, stock = _pair(_Dropout())
    b = _batch(model.config.vocab_size)
    want, got = _loss(stock, b).item(), _loss(model, b).item()
    assert got == pytest.approx(want, rel=1e-6), (got, want)

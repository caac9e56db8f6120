"""Forward-mode AD with the tangent on a logit-scale operand (Cohere's ``logits = logits *
self.logit_scale``, here a learnable 0-d Parameter, the tangent put on it with
``torch.func.functional_call``): the patched forward steps aside to stock, so the JVP includes d
loss / d scale (``.item()`` of the dual dropped it). Found or checked by an adversarial pass
(2026-12-05).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import transformers
from torch.func import functional_call

from fused_ce_patch import apply_fused_ce
from fused_ce_patch.hf import loss_mapping
from fused_ce_patch.hf.tiny import tiny_config
from hf_helpers import short_batch as _batch


def _jvp(model, b):
    with fwAD.dual_level():
        s = fwAD.make_dual(torch.tensor(0.25), torch.tensor(1.0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = functional_call(model, {"logit_scale": s}, (), b)
        primal, tangent = fwAD.unpack_dual(out.loss)
        return primal.item(), None if tangent is None else tangent.item()


def test_dual_logit_scale_gives_stock_jvp():
    torch.manual_seed(0)
    model = transformers.CohereForCausalLM(tiny_config("cohere")).train()
    model.logit_scale = torch.nn.Parameter(torch.tensor(0.25))
    stock = copy.deepcopy(model)
    stock.loss_function = loss_mapping.original_causal_lm_loss()
    apply_fused_ce(model, backend="torch")
    b = _batch(model.config.vocab_size)
    want = _jvp(stock, b)
    got = _jvp(model, b)
    assert want[1] is not None and want[1] != 0.0
    assert got[1] is not None and got == pytest.approx(want, rel=1e-5), (got, want)

"""A parametrization on the head's bias is evaluated once per fused forward, after the weight's,
as stock's ``F.linear(x, self.weight, self.bias)`` does (hf/head.py ``_plain_linear``): one that
draws random numbers or updates state then gives stock's loss. Found by an adversarial pass
(2026-12-05): the bias was evaluated four times.
"""

import copy
import warnings

import torch
import torch.nn.utils.parametrize as P

from fused_ce_patch import apply_fused_ce
from hf_helpers import batch, build_model, reference_copy
from hf_helpers import CountingParametrization as _Count, DropoutParametrization as _Dropout


def _pair():
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    torch.manual_seed(3)
    head = torch.nn.Linear(32, model.config.vocab_size, bias=True)
    for m in (model, ref):
        m.lm_head = copy.deepcopy(head)
    return model, ref


def _loss(model, seed=7):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(**batch()).loss


def test_bias_parametrization_evaluated_once_as_stock():
    model, ref = _pair()
    counts = {}
    for name, m in (("patched", model), ("stock", ref)):
        P.register_parametrization(m.lm_head, "bias", _Count())
        m.lm_head.parametrizations.bias[0].n = 0  # registration evaluates it once
        _loss(m).backward()
        counts[name] = m.lm_head.parametrizations.bias[0].n
    assert counts == {"patched": 1, "stock": 1}


def test_random_bias_parametrization_gives_stock_loss():
    model, ref = _pair()
    for m in (model, ref):
        P.register_parametrization(m.lm_head, "bias", _Dropout())
    want, got = _loss(ref).item(), _loss(model).item()
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)

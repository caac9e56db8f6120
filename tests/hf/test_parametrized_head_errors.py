"""A parametrized lm_head leaves the dtype and vocab_size checks to the loss (reading the weight
would evaluate the parametrization); the loss then raises stock's exception type for a
config.vocab_size that is not the head's rows (RuntimeError from ``logits.view(-1, V)``). A
parametrization that changes the weight's dtype (``unsafe=True``) still raises TypeError where
stock raises RuntimeError: a strict xfail, docs/limits.md. Found by an adversarial pass
(2026-12-05).
"""

import copy
import warnings

import pytest
import torch
import torch.nn.utils.parametrize as P

from fused_ce_patch import apply_fused_ce
from hf_helpers import batch, build_model, reference_copy


class _ToDouble(torch.nn.Module):
    def forward(self, w):
        return w.double()


class _Ident(torch.nn.Module):
    def forward(self, w):
        return w


def _pair(parametrization):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, ref):
        P.register_parametrization(m.lm_head, "weight", copy.deepcopy(parametrization),
                                   unsafe=True)
    return model, ref


def _exc(m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            m(**batch())
        except Exception as e:  # noqa: BLE001
            return type(e)
    return None


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="known limit: the fused loss raises TypeError for the dtype mismatch")
def test_dtype_changing_parametrization_raises_stock_exception_type():
    model, ref = _pair(_ToDouble())
    want = _exc(ref)
    assert want is RuntimeError
    assert _exc(model) is want


def test_wrong_vocab_size_parametrized_head_raises_stock_exception_type():
    model, ref = _pair(_Ident())
    for m in (model, ref):
        m.config.vocab_size = 1000  # head has 1003 rows
    want = _exc(ref)
    assert want is RuntimeError
    assert _exc(model) is want

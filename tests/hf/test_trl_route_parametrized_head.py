"""TRL's routed log-prob kernel finds the patched owner of the weight it is given without reading a
parametrized head's ``weight`` (which would evaluate it, and advance spectral_norm's power
iteration): a TRL call from another, never-patched model leaves the patched model's
parametrization and its next loss as stock's. Found by an adversarial pass (2026-12-05).
"""

import warnings

import pytest
import torch
import torch.nn.utils.parametrize as P

from fused_ce_patch import apply_fused_ce
from hf_helpers import batch, build_model, reference_copy
from hf_helpers import CountingParametrization as _Count

trl = pytest.importorskip("trl")


def _trl_call(weight):
    import trl.trainer.utils as utils_mod

    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, weight.shape[1], generator=g)
    y = torch.randint(0, weight.shape[0], (12,), generator=g)
    return utils_mod._ChunkedLogProbFunction.apply(h, weight, None, y, 1.0, 4096, None, 1.0,
                                                   ("log_probs",))


def test_other_models_trl_call_does_not_evaluate_patched_parametrization():
    patched = apply_fused_ce(build_model("llama"), backend="torch")
    P.register_parametrization(patched.lm_head, "weight", _Count())
    count = patched.lm_head.parametrizations.weight[0]
    other = build_model("llama", seed=3)  # never patched
    count.n = 0
    _trl_call(other.lm_head.weight)
    assert count.n == 0


def test_spectral_norm_head_loss_unchanged_by_trl_calls():
    base = build_model("llama")
    ref = reference_copy(base)
    model = apply_fused_ce(base, backend="torch")
    for m in (model, ref):
        torch.manual_seed(9)
        torch.nn.utils.parametrizations.spectral_norm(m.lm_head)
    other = build_model("llama", seed=3)
    for _ in range(5):
        _trl_call(other.lm_head.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, got = ref(**batch()).loss.item(), model(**batch()).loss.item()
    assert got == pytest.approx(want, rel=1e-5), (got, want)

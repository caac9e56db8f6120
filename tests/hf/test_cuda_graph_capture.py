"""While a CUDA graph is being captured: the fused functions refuse with a clear error, and a
patched model (and the loss-mapping opt-in) computes the stock loss.

The fused losses read their labels' range and count on the host. CUDA refuses that
synchronisation during a capture (its error ends the capture), and a replay would reuse the
captured batch's count. CPU has no capture, so ``_capture`` stands one in for
``errors.cuda_graph_capturing`` (after the patch: its proof runs outside any capture); each
test has its control without it.
tests/gpu/test_compile_gpu.py captures a real one.
"""

from __future__ import annotations

import pytest
import torch

from fused_ce_patch import (apply_fused_ce, errors, fused_linear_cross_entropy, fused_linear_jsd,
                            fused_linear_token_stats)
from fused_ce_patch.hf import loss_mapping
from hf_helpers import VOCAB, batch, build_model, compare_with_stock, reference_copy

CAPTURE = "CUDA graph is being captured"


def _capture(monkeypatch):
    monkeypatch.setattr(errors, "cuda_graph_capturing", lambda device: True)


@pytest.fixture
def capturing(monkeypatch):
    _capture(monkeypatch)


def test_no_capture_off_cuda():
    for device in ("cpu", "meta"):
        assert errors.cuda_graph_capturing(torch.device(device)) is False
        errors.raise_if_capturing(torch.device(device), "x")  # no error


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    w = torch.randn(37, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 37, (2, 5), generator=g)
    y[0, 1] = -100
    return h, w, y


CALLS = {
    "fused_linear_cross_entropy": lambda h, w, y: fused_linear_cross_entropy(h, w, y),
    "fused_linear_token_stats": lambda h, w, y: fused_linear_token_stats(h, w, y),
    "fused_linear_jsd": lambda h, w, y: fused_linear_jsd(h, w, h.detach(), w.detach() * 0.5, y),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_functionals_refuse_while_capturing(name, capturing):
    with pytest.raises(RuntimeError, match=CAPTURE):
        CALLS[name](*_inputs())


@pytest.mark.parametrize("name", sorted(CALLS))
def test_functionals_run_without_a_capture(name):
    assert CALLS[name](*_inputs()) is not None


def _patched_and_reference():
    model = build_model("llama")
    ref = reference_copy(model)
    return apply_fused_ce(model, backend="torch"), ref


def test_patched_model_runs_stock_while_capturing(monkeypatch, spy):
    model, ref = _patched_and_reference()
    _capture(monkeypatch)
    with pytest.warns(RuntimeWarning, match=CAPTURE):
        compare_with_stock(model, ref, batch(), fused=False, spy=spy)


def test_patched_model_fuses_without_a_capture(spy):
    model, ref = _patched_and_reference()
    compare_with_stock(model, ref, batch(), fused=True, spy=spy)


@pytest.mark.parametrize("capture", [True, False])
def test_loss_mapping_opt_in_is_stock_while_capturing(capture, monkeypatch, logits_loss_spy):
    if capture:
        _capture(monkeypatch)
    b = batch()
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(*b["labels"].shape, VOCAB, generator=g, requires_grad=True)
    got = loss_mapping.chunked_causal_lm_loss(logits, b["labels"], VOCAB)
    want = loss_mapping.original_causal_lm_loss()(logits, b["labels"], VOCAB)
    assert logits_loss_spy.count == (0 if capture else 1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)

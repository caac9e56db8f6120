"""TRL's routed kernels (hf/trl.py: the fused LM head's log-probs, the DistillationTrainer's
divergence) hand a call made during a (stand-in) CUDA graph capture to TRL's own kernel, as for
an unpatched model, instead of the fused functions' capture error; without a capture they
compute as TRL's kernel does. Found or checked by an adversarial pass (2026-12-05).
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from fused_ce_patch import apply_fused_ce, errors  # noqa: E402
from hf_helpers import build_model  # noqa: E402


def _capture(monkeypatch):
    monkeypatch.setattr(errors, "cuda_graph_capturing", lambda device: True)


def _operands(model):
    w = model.get_output_embeddings().weight
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 6, w.shape[1], generator=g)
    y = torch.randint(0, w.shape[0], (2, 6), generator=g)
    return h, w, y


@pytest.mark.parametrize("capture", [False, True])
def test_trl_logprob_route_steps_aside_while_capturing(capture, monkeypatch):
    import trl.trainer.utils as utils_mod

    model = apply_fused_ce(build_model("llama"), backend="torch")
    route = utils_mod._ChunkedLogProbFunction
    assert hasattr(route, "original"), "route not installed"
    h, w, y = _operands(model)
    h, y = h.reshape(-1, h.shape[-1]), y.reshape(-1)  # TRL's kernel takes [N, H], [N]
    outputs = ("log_probs", "entropy")
    want = route.original.apply(h, w, None, y, 1.0, 4096, None, 1.0, outputs)
    if capture:
        _capture(monkeypatch)
    got = route.apply(h, w, None, y, 1.0, 4096, None, 1.0, outputs)  # RuntimeError if capturing
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capture", [False, True])
def test_trl_divergence_route_steps_aside_while_capturing(capture, monkeypatch):
    distillation_trainer = pytest.importorskip("trl.trainer.distillation_trainer")
    if not hasattr(distillation_trainer, "_chunked_divergence_loss"):
        pytest.skip("no _chunked_divergence_loss in this TRL")
    model = apply_fused_ce(build_model("llama"), backend="torch")
    route = distillation_trainer._chunked_divergence_loss
    original = route.__wrapped__
    h, w, _ = _operands(model)
    t = torch.randn(h.shape, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(h.shape[:-1], dtype=torch.long)
    want = original(h, t, w, w.detach() * 2, mask, 0.5)
    if capture:
        _capture(monkeypatch)
    got = route(h, t, w, w.detach() * 2, mask, 0.5)  # RuntimeError if capturing
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)

"""fused_linear_token_stats on a CUDA GPU (marker ``gpu``; skipped without CUDA).

Run: ``pytest -m gpu tests/gpu/test_token_stats_gpu.py -q``. The Triton row kernel (the CUDA
default, with and without a ForwardGradHint) and the torch tiles (compiled and eager) are held
to the error of PyTorch's own path (bf16 logits, float32 log-softmax) against a float32
reference; with trl >= 1.15 installed, the per-token
outputs are compared with TRL's own kernel too.
"""

from __future__ import annotations

import math

import pytest
import torch

from fused_ce_patch import ForwardGradHint, fused_linear_token_stats
from fused_ce_patch.backends.token_stats import COMPILE_ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLACK = 1.25


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _inputs(n=4096, h=1024, v=50257, softcap=None):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16()
    weight.requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    return hidden, weight, labels


def _reference(hidden, weight, labels, softcap, *, fp32_logits):
    h = hidden.detach().float().requires_grad_() if fp32_logits else hidden.detach().clone()
    w = weight.detach().float().requires_grad_() if fp32_logits else weight.detach().clone()
    if not fp32_logits:
        h.requires_grad_()
        w.requires_grad_()
    z = (h @ w.t()).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z, -1)
    mask = labels != -100
    lp = logp.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1) * mask
    ent = -(logp.exp() * logp).sum(-1) * mask
    g = torch.linspace(-1, 1, labels.numel(), device="cuda")
    dh, dw = torch.autograd.grad((lp * g).sum() + 0.1 * ent.sum(), [h, w])
    return lp.detach(), ent.detach(), dh, dw, g


PATHS = {  # name: (backend, $FUSED_CE_TOKEN_STATS_COMPILE, grad hint, column-tiled backward)
    "triton": ("auto", "1", False, False),
    "triton-hint": ("auto", "1", True, False),
    "triton-columns": ("auto", "1", False, True),
    "tiles-compiled": ("torch", "1", False, False),
    "tiles-eager": ("torch", "0", False, False),
}


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("path", list(PATHS))
def test_bf16_no_worse_than_torch(softcap, path, monkeypatch):
    backend, compiled, use_hint, columns = PATHS[path]
    monkeypatch.setenv(COMPILE_ENV, compiled)
    if columns:  # at this shape the row chunks would be taken: force two column tiles
        from fused_ce_patch.backends.triton import token_stats as triton_stats

        monkeypatch.setattr(triton_stats, "COL_MIN_ROW_GAIN", 0)
        ran, real = [], triton_stats._grad_pass_columns
        monkeypatch.setattr(triton_stats, "_grad_pass_columns",
                            lambda *a, **k: (ran.append(a[5]), real(*a, **k))[1])
    hidden, weight, labels = _inputs(softcap=softcap)
    ref = _reference(hidden, weight, labels, softcap, fp32_logits=True)
    naive = _reference(hidden, weight, labels, softcap, fp32_logits=False)
    hint = ForwardGradHint() if use_hint else None
    for step in range(2 if use_hint else 1):  # with the hint: its mismatch, then recompute
        out = fused_linear_token_stats(hidden, weight, labels, softcap=softcap, entropy=True,
                                       accuracy=True, backend=backend, grad_hint=hint)
        dh, dw = torch.autograd.grad((out.log_probs * ref[4]).sum() + 0.1 * out.entropy.sum(),
                                     [hidden, weight])
        for name, got, want, base in (("log_probs", out.log_probs, ref[0], naive[0]),
                                      ("entropy", out.entropy, ref[1], naive[1]),
                                      ("dH", dh, ref[2], naive[2]), ("dW", dw, ref[3], naive[3])):
            err, floor = rel(got, want), rel(base, want)
            assert err <= SLACK * floor + 1e-6, f"{name}: {err:.2e} vs torch's {floor:.2e}"
    if use_hint:
        assert not hint.on
    if columns:
        assert len(ran) == 1 and ran[0].cols < weight.shape[0], ran


def test_forward_grad_hint_sft_loss_matches_recompute():
    hidden, weight, labels = _inputs(softcap=30.0)
    hint = ForwardGradHint()
    grads = []
    for h in (hint, None):
        out = fused_linear_token_stats(hidden, weight, labels, softcap=30.0, entropy=True,
                                       accuracy=True, grad_hint=h)
        loss = -out.log_probs.sum() / out.mask.sum()
        grads.append(torch.autograd.grad(loss, [hidden, weight]))
    assert hint.on
    for a, b in zip(*grads):
        assert rel(a, b) < 1e-2  # both bf16 roundings of the same float32 gradient


def test_matches_trl_kernel():
    kernels = pytest.importorskip("trl.kernels", reason="needs trl >= 1.15")
    hidden, weight, labels = _inputs(n=2048, v=32000)
    mask = labels != -100
    lp_t, ent_t, _, _, top_t = kernels.ChunkedLogProbFunction.apply(
        hidden[mask], weight, None, labels[mask], 1.0, 32768, None, 1.0,
        ("log_probs", "entropy", "is_top1"))
    out = fused_linear_token_stats(hidden[mask], weight, labels[mask], entropy=True,
                                   accuracy=True)
    assert rel(out.log_probs, lp_t) < 1e-3 and rel(out.entropy, ent_t) < 1e-3
    assert (out.is_top1 == top_t).float().mean() > 0.99

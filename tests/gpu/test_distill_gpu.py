"""fused_linear_jsd on a CUDA GPU (marker ``gpu``; skipped without CUDA).

Run: ``pytest -m gpu tests/gpu/test_distill_gpu.py -q``. The Triton row kernel (the CUDA
default) and the torch row ops against a float64 materialised reference from the same bf16
inputs, several chunks, every beta kind, softcap, a teacher that requires grad; with trl
installed, against TRL's own ``ChunkedDivergenceFunction`` too.

Tolerances: loss 2e-5 (float32 arithmetic after float32-accumulated matmuls); gradients
2**-7 relative (dz rounded once to bf16 for the dH/dW matmuls, dH once more; dW summed over
the chunks in bf16 by cuBLAS, one rounding a chunk: ~sqrt(chunks) * 2**-9 at 8 chunks).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from fused_ce_patch import fused_linear_jsd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _inputs(n=2048, hs=512, ht=768, v=32003, teacher_grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(rows, cols):
        return (torch.randn(rows, cols, device="cuda", generator=g) * 2 / math.sqrt(cols))

    out = dict(
        hs=torch.randn(n, hs, device="cuda", generator=g).bfloat16().requires_grad_(),
        ws=w(v, hs).bfloat16().requires_grad_(),
        ht=torch.randn(n, ht, device="cuda", generator=g).bfloat16().requires_grad_(teacher_grad),
        wt=w(v, ht).bfloat16().requires_grad_(teacher_grad),
        labels=torch.randint(0, v, (n,), device="cuda", generator=g),
    )
    out["labels"][torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    return out


def _reference(d, beta, temperature, softcap):
    leaves = {k: d[k].detach().double().requires_grad_(d[k].requires_grad)
              for k in ("hs", "ws", "ht", "wt")}
    mask = d["labels"] != -100
    zs = leaves["hs"][mask] @ leaves["ws"].t()
    zt = leaves["ht"][mask] @ leaves["wt"].t()
    if softcap is not None:
        zs, zt = softcap * torch.tanh(zs / softcap), softcap * torch.tanh(zt / softcap)
    ls, lt = (zs / temperature).log_softmax(-1), (zt / temperature).log_softmax(-1)
    if beta == 0.0:
        rows = (lt.exp() * (lt - ls)).sum(-1)
    elif beta == 1.0:
        rows = (ls.exp() * (ls - lt)).sum(-1)
    else:
        log_m = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
        rows = (beta * (lt.exp() * (lt - log_m)).sum(-1)
                + (1 - beta) * (ls.exp() * (ls - log_m)).sum(-1))
    loss = rows.sum() / mask.sum()
    want = [k for k in leaves if leaves[k].requires_grad]
    grads = torch.autograd.grad(loss, [leaves[k] for k in want])
    return loss, dict(zip(want, grads))


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("teacher_grad", [False, True])
def test_jsd_vs_float64(backend, beta, softcap, teacher_grad):
    d = _inputs(teacher_grad=teacher_grad)
    loss = fused_linear_jsd(d["hs"], d["ws"], d["ht"], d["wt"], d["labels"], beta=beta,
                            temperature=2.0, student_softcap=softcap, teacher_softcap=softcap,
                            logits_budget=64 * 2**20, backend=backend)  # several chunks
    loss.backward()
    want, grads = _reference(d, beta, 2.0, softcap)
    assert rel(loss, want) < 2e-5
    for k, g in grads.items():
        assert rel(d[k].grad, g) < 2.0**-7, (k, rel(d[k].grad, g))


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed")
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_matches_trl_chunked_divergence(beta):
    pytest.importorskip("datasets", reason="trl's distillation_trainer imports datasets "
                        "(benchmarks/gpu_jsd.py compares with TRL through a stand-in)")
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    d = _inputs()
    loss, ent = fused_linear_jsd(d["hs"], d["ws"], d["ht"], d["wt"], d["labels"], beta=beta,
                                 return_student_entropy=True)
    mask = (d["labels"] != -100).unsqueeze(0)
    t_loss, t_ent, n = _chunked_divergence_loss(d["hs"].unsqueeze(0), d["ht"].unsqueeze(0),
                                                d["ws"], d["wt"], mask, beta)
    assert rel(loss, t_loss) < 2e-5
    assert rel(ent.sum(), t_ent) < 2e-5

"""The DistillationTrainer route of a patched student returns what TRL's own
``_chunked_divergence_loss`` returns, dtypes and shapes included: float32 sums for a float64
model, ``num_items_in_batch``'s dtype and shape in the division, TRL's own function for hidden
states that are not 2-D or 3-D, and float32 products under CPU bf16 autocast. Found by an
adversarial pass (2026-12-05).
"""

from __future__ import annotations

import warnings

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is optional; install trl to run this test")
distillation_trainer = pytest.importorskip("trl.trainer.distillation_trainer")
if not hasattr(distillation_trainer, "_chunked_divergence_loss"):
    pytest.skip("this TRL's DistillationTrainer has no _chunked_divergence_loss",
                allow_module_level=True)

from fused_ce_patch import apply_fused_ce, revert_fused_ce  # noqa: E402
from hf_helpers import build_model  # noqa: E402


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.fixture
def setup():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        student = apply_fused_ce(build_model("llama", seed=0))
    route = distillation_trainer._chunked_divergence_loss
    yield student, route, route.__wrapped__
    revert_fused_ce(student)


def _inputs(w, dtype=torch.float32):
    torch.manual_seed(0)
    hs, ht = torch.randn(2, 5, w.shape[1], dtype=dtype), torch.randn(2, 5, 24, dtype=dtype)
    wt = torch.randn(w.shape[0], 24, dtype=dtype) * 0.5
    mask = torch.ones(2, 5, dtype=torch.long)
    return hs, ht, wt, mask


@pytest.mark.parametrize("lead", ["4d", "1d"])
def test_other_ranks_go_to_trl(setup, lead):
    student, route, original = setup
    w = student.get_output_embeddings().weight
    hs, ht, wt, mask = _inputs(w)
    if lead == "4d":
        hs, ht, mask = hs[None], ht[None], mask[None]
    else:
        hs, ht, mask = hs[0, 0], ht[0, 0], mask[0, 0]
    want = original(hs, ht, w, wt, mask, 0.5)
    got = route(hs, ht, w, wt, mask, 0.5)
    torch.testing.assert_close(got[0], want[0])


def test_float64_model_gets_trls_dtypes(setup):
    student, route, original = setup
    student.double()
    w = student.get_output_embeddings().weight
    hs, ht, wt, mask = _inputs(w, torch.float64)
    want = original(hs, ht, w, wt, mask, 0.5)
    got = route(hs, ht, w, wt, mask, 0.5)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert _rel(got[0], want[0]) < 1e-6


@pytest.mark.parametrize("num_items", [torch.tensor(7.0, dtype=torch.float64),
                                       torch.tensor([7]), 7, 2.5])
def test_num_items_in_batch_divides_as_trl(setup, num_items):
    student, route, original = setup
    w = student.get_output_embeddings().weight
    hs, ht, wt, mask = _inputs(w)
    want = original(hs, ht, w, wt, mask, 0.5, num_items_in_batch=num_items)
    got = route(hs, ht, w, wt, mask, 0.5, num_items_in_batch=num_items)
    assert (got[0].dtype, got[0].shape) == (want[0].dtype, want[0].shape)
    assert _rel(got[0], want[0]) < 1e-6


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_cpu_autocast_matches_trl(setup, beta):
    student, route, original = setup
    w = student.get_output_embeddings().weight
    torch.manual_seed(0)
    hs, ht = torch.randn(2, 5, w.shape[1]), torch.randn(2, 5, 24)
    wt = torch.randn(w.shape[0], 24) * 0.5
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, 3:] = 0
    out = []
    for fn in (route, original):
        h = hs.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, ent, _ = fn(h, ht, w, wt, mask, beta)
        out.append((loss, ent, *torch.autograd.grad(loss, [h, w])))
    (l1, e1, gh1, gw1), (l2, e2, gh2, gw2) = out
    assert _rel(l1, l2) < 1e-5, (l1.item(), l2.item())
    assert _rel(e1, e2) < 1e-5, (e1.item(), e2.item())
    assert _rel(gh1, gh2) < 5e-3 and _rel(gw1, gw2) < 5e-3

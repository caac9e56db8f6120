"""A float32-output head (Ergo's ``ErgoLinearWithFP32Output``, issue 37).

Its forward multiplies in float32 with autocast off: ``F.linear(h.float(), W.to(h.dtype).float())``,
``h`` cast to the weight's dtype first. The fused loss takes those very operands, with autocast
off (hf/head.py ``fp32_output_head``), so it gives stock's loss in float32, bfloat16 and under
autocast; anything else with that class name, or the head inside a wrapper, is not taken.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from fused_ce_patch import apply_fused_ce
from fused_ce_patch.hf.head import fp32_output_head
from fused_ce_patch.hf.sentinel import NotMaterializedLogits
from fused_ce_patch.hf.tiny import tiny_config
from hf_helpers import assert_step_close

pytestmark = pytest.mark.usefixtures("fresh_proofs")  # tests/hf/conftest.py

V = 300


def _ergo(dtype):
    config = tiny_config("ergo")
    config.vocab_size = V
    torch.manual_seed(0)
    return transformers.ErgoForCausalLM(config).to(dtype).train()


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (2, 12), generator=g)
    labels = ids.clone()
    labels[1, 8:] = -100
    return {"input_ids": ids, "labels": labels}


def _run(model, batch, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**batch)
    out.loss.backward()
    return out, out.loss.detach(), {k: p.grad.float().clone() for k, p in
                                    model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype, autocast, loss_tol, grad_tol", [
    # float32 operands both ways: the fused loss differs by summation order only (~1e-7)
    (torch.float32, False, 1e-5, 1e-5),
    # bfloat16 weights, float32 products in both: the loss as in float32; the gradients are
    # rounded to bfloat16 (2**-8 relative) where they reach the bfloat16 parameters
    (torch.bfloat16, False, 1e-5, 2e-2),
    (torch.float32, True, 1e-5, 2e-2),
])
def test_fused_loss_takes_the_heads_own_float32_operands(dtype, autocast, loss_tol, grad_tol):
    model, batch = _ergo(dtype), _batch()
    assert fp32_output_head(model.lm_head)
    want = _run(model, batch, autocast)
    apply_fused_ce(model, backend="torch")
    got = _run(model, batch, autocast)
    assert isinstance(got[0].logits, NotMaterializedLogits)
    assert got[1].dtype == want[1].dtype == torch.float32
    assert_step_close(got, want, loss_tol, grad_tol)


def test_only_transformers_own_float32_head_is_taken():
    model = _ergo(torch.float32)
    cls = type(model.lm_head)

    class Changed(cls):  # same behaviour, another class
        pass

    head = Changed(4, 5)
    assert not fp32_output_head(head)
    assert not fp32_output_head(torch.nn.Linear(4, 5, bias=False))
    with_bias = cls(4, 5)
    with_bias.bias = torch.nn.Parameter(torch.zeros(5))
    assert not fp32_output_head(with_bias)

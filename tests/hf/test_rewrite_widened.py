"""What the forward rewrite expresses beyond head, transform, loss (hf/architectures.py).

RecurrentGemma soft-caps in one line after reading the cap into a local
(``cap = self.config.logits_soft_cap``; ``logits = tanh(logits / cap) * cap``): refused before,
now derived as a softcap and proven like every other type.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_outputs import CausalLMOutput

from fused_ce_patch import UnsupportedModelError, apply_fused_ce
from fused_ce_patch.hf import architectures
from fused_ce_patch.hf.architectures import derive_spec
from fused_ce_patch.hf.sentinel import NotMaterializedLogits


pytestmark = pytest.mark.usefixtures("fresh_proofs")  # tests/hf/conftest.py


def test_recurrent_gemma_one_line_softcap_is_patched_and_matches_stock():
    config = transformers.RecurrentGemmaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, lru_width=64, attention_window_size=8,
        logits_soft_cap=5.0, block_types=["recurrent", "recurrent", "attention"])
    spec = derive_spec(transformers.RecurrentGemmaForCausalLM)
    assert spec.transform_name == "softcap", spec.transform
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(config).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 12), generator=g)
    batch = {"input_ids": ids, "labels": ids}

    def run():
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        return out, out.loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()
                                        if p.grad is not None}

    _, want, want_grads = run()
    apply_fused_ce(model, backend="torch")
    out, loss, grads = run()
    assert isinstance(out.logits, NotMaterializedLogits)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    assert grads.keys() == want_grads.keys()
    floor = 1e-3 * max(g.norm() for g in want_grads.values())
    for k, w in want_grads.items():
        assert (grads[k] - w).norm() <= 1e-5 * max(w.norm(), floor), k


def _forward_pure(self, input_ids=None, labels=None, **kwargs):
    hidden_states = self.model(input_ids).last_hidden_state
    logits = self.lm_head(hidden_states)
    cap = self.config.logits_soft_cap
    logits = torch.tanh(logits / cap) * cap
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                  **kwargs)
    return CausalLMOutput(loss=loss, logits=logits)


def _forward_call(self, input_ids=None, labels=None, **kwargs):
    hidden_states = self.model(input_ids).last_hidden_state
    logits = self.lm_head(hidden_states)
    cap = self.config.get_cap()
    logits = torch.tanh(logits / cap) * cap
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                  **kwargs)
    return CausalLMOutput(loss=loss, logits=logits)


def _forward_other_cap(self, input_ids=None, labels=None, **kwargs):
    hidden_states = self.model(input_ids).last_hidden_state
    logits = self.lm_head(hidden_states)
    cap = self.config.logits_soft_cap
    logits = torch.tanh(logits / cap) * self.config.other
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                  **kwargs)
    return CausalLMOutput(loss=loss, logits=logits)


def test_locals_and_only_a_matching_cap_are_expressed():
    spec = architectures._derive(type("Pure", (), {"forward": _forward_pure}), _forward_pure)
    assert spec.transform_name == "softcap"
    # a local computed by a call never sees the logits: it runs where stock runs it
    spec = architectures._derive(type("Call", (), {"forward": _forward_call}), _forward_call)
    assert spec.transform_name == "softcap"
    with pytest.raises(UnsupportedModelError, match="unknown statement"):
        architectures._derive(type("Other", (), {"forward": _forward_other_cap}),
                              _forward_other_cap)


def _forward_no_loss(self, input_ids=None, **kwargs):
    return self.lm_head(self.model(input_ids).last_hidden_state)


def test_a_forward_without_labels_or_loss_says_there_is_nothing_to_fuse():
    from fused_ce_patch.errors import NoLossToFuseError
    from fused_ce_patch.hf.sweep import check_type

    with pytest.raises(NoLossToFuseError, match="takes no labels and computes no loss"):
        architectures._derive(type("Draft", (), {"forward": _forward_no_loss}), _forward_no_loss)
    # Gemma 4's assistant (draft) head: its caller computes the loss from its logits
    row = check_type("gemma4_assistant")
    assert row["status"] == "noloss", row
    assert isinstance(NoLossToFuseError("x"), UnsupportedModelError)

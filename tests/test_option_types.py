"""Options that are not numbers or booleans are refused the same way on every entry point
(found by an adversarial pass: these were accepted and silently changed the result)."""

import pytest
import torch

from fused_ce_patch import (
    apply_fused_ce,
    apply_fused_ce_to_class,
    fused_linear_cross_entropy,
    fused_linear_token_stats,
)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 5, 8, generator=g), torch.randn(11, 8, generator=g),
            torch.randint(0, 11, (2, 5), generator=g))


@pytest.mark.parametrize("option", [{"softcap": True}, {"ignore_index": True},
                                    {"logit_scale": True}, {"temperature": True},
                                    {"logits_budget": True}, {"shift": "no"}])
def test_token_stats_refuses_non_numbers_and_non_bools(option):
    h, w, y = _inputs()
    with pytest.raises(TypeError, match=next(iter(option))):
        fused_linear_token_stats(h, w, y, backend="torch", **option)


@pytest.mark.parametrize("shift", ["no", 0, 1, None])
def test_loss_shift_must_be_a_bool(shift):
    h, w, y = _inputs()
    with pytest.raises(TypeError, match="shift"):
        fused_linear_cross_entropy(h, w, y, shift=shift, backend="torch")


def test_apply_refuses_non_models_and_non_bool_return_logits():
    with pytest.raises(TypeError, match="nn.Module"):
        apply_fused_ce(42)
    with pytest.raises(TypeError, match="needs a class"):
        apply_fused_ce_to_class("LlamaForCausalLM")
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=16,
                                         intermediate_size=32, num_attention_heads=2,
                                         num_key_value_heads=1, vocab_size=50))
    with pytest.raises(TypeError, match="return_logits"):
        apply_fused_ce(model, return_logits="no")

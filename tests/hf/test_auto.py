"""AutoFusedCEForCausalLM.from_pretrained / from_config."""

from __future__ import annotations

import pytest
import torch

from fused_ce_patch import AutoFusedCEForCausalLM, UnsupportedModelError
from fused_ce_patch.hf.patch import is_fused_ce_applied
from fused_ce_patch.hf.sentinel import NotMaterializedLogits
from hf_helpers import LOSS_RTOL, assert_close_rel, batch, build_model, reference_copy, tiny_config


def test_from_config(spy):
    model = AutoFusedCEForCausalLM.from_config(tiny_config("gemma3_text"),
                                               fused_ce_backend="reference")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert is_fused_ce_applied(model) and not is_fused_ce_applied(type(model))
    model.train()
    assert isinstance(model(**batch()).logits, NotMaterializedLogits)
    assert spy.calls[0]["backend"] == "reference"


def test_from_pretrained(tmp_path, spy):
    saved = build_model("mistral")
    saved.save_pretrained(tmp_path)
    ref = reference_copy(saved)
    model = AutoFusedCEForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                   fused_ce_logits_budget=8192)
    assert is_fused_ce_applied(model) and model._fused_ce_state.options.logits_budget == 8192
    model.train()
    b = batch()
    got, want = model(**b), ref(**b)
    assert spy.count == 1
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss")


def test_unsupported_config_fails_before_loading():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="gpt2"):
        AutoFusedCEForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2))

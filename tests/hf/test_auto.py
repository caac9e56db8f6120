"""AutoFusedCEForCausalLM.from_pretrained / from_config."""

from __future__ import annotations

import pytest
import torch

from fused_ce_patch import AutoFusedCEForCausalLM, UnsupportedModelError, apply_fused_ce
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


def _xlm_config():
    # XLM computes its loss inside its prediction layer (`self.pred_layer(output, labels)`): a
    # type the derivation refuses. (BERT was the example until its head with a transform
    # became supported, hf/head_path.py.)
    from transformers import XLMConfig

    return XLMConfig(n_layers=1, emb_dim=16, n_heads=2, vocab_size=97)


def _ours(record):
    return [w for w in record if "AutoFusedCEForCausalLM" in str(w.message)]


@pytest.mark.parametrize("how", ["from_config", "from_pretrained"])
def test_unsupported_model_loads_unpatched_with_one_warning(how, tmp_path, spy):
    # Regression (issue 9 item 5): an unsupported model type used to raise.
    from transformers import AutoModelForCausalLM

    with pytest.warns(UserWarning) as record:
        if how == "from_config":
            model = AutoFusedCEForCausalLM.from_config(_xlm_config(),
                                                       fused_ce_backend="torch")
        else:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(_xlm_config()).save_pretrained(tmp_path)
            model = AutoFusedCEForCausalLM.from_pretrained(tmp_path, fused_ce_backend="torch")
    ours = _ours(record)
    assert len(ours) == 1, [str(w.message) for w in record]
    assert "XLMWithLMHeadModel" in str(ours[0].message) and "xlm" in str(ours[0].message)
    assert type(model).__name__ == "XLMWithLMHeadModel" and not is_fused_ce_applied(model)
    assert "forward" not in model.__dict__ and "_loss_function" not in model.__dict__
    model.train()
    ids = torch.randint(0, 97, (2, 8))
    out = model(input_ids=ids, labels=ids)
    assert isinstance(out.logits, torch.Tensor) and torch.isfinite(out.loss) and spy.count == 0
    with pytest.raises(UnsupportedModelError, match="xlm"):  # the explicit call still refuses
        apply_fused_ce(model)


def test_bad_option_still_raises_before_loading(monkeypatch):
    from transformers import AutoModelForCausalLM

    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded before the options were checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", no_load)
    with pytest.raises(ValueError, match="unknown backend"):
        AutoFusedCEForCausalLM.from_config(_xlm_config(), fused_ce_backend="nope")
    with pytest.raises(TypeError, match="logits_budget"):
        AutoFusedCEForCausalLM.from_pretrained("x", fused_ce_logits_budget=True)

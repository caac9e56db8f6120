"""Patched models during a (stand-in) CUDA graph capture step aside to stock with stock's loss: the
CrossEntropyLoss form (Bart), Bamba's z-loss, Gemma2's softcap, PEFT LoRA,
AutoFusedCEForCausalLM; without a capture they fuse. A 0-d tensor logit-scale operand is not
read on the host during a capture (stock's ``logits * scale`` does not read it either). Found or
checked by an adversarial pass (2026-12-05).
"""

from __future__ import annotations

import copy
import traceback
import warnings

import pytest
import torch
import transformers

from fused_ce_patch import apply_fused_ce, errors
from fused_ce_patch import loss as fused_loss
from fused_ce_patch.hf import loss_mapping
from fused_ce_patch.hf.tiny import tiny_config
from hf_helpers import build_model, reference_copy, short_batch as _batch


def _capture(monkeypatch):
    monkeypatch.setattr(errors, "cuda_graph_capturing", lambda device: True)


def _tiny(model_type, cls, **overrides):
    config = tiny_config(model_type)
    for k in ("encoder_attention_heads", "decoder_attention_heads"):
        if hasattr(config, k):
            setattr(config, k, 4)
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    return cls(config).double().train()


def _lora_llama():
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(build_model("llama").double(), peft.LoraConfig(
        r=4, target_modules=["lm_head"], lora_dropout=0.0, init_lora_weights=False))


MODELS = {
    "bart_ce_form": lambda: _tiny("bart", transformers.BartForCausalLM),
    "bamba_z_loss": lambda: _tiny("bamba", transformers.BambaForCausalLM,
                                  z_loss_coefficient=0.25),
    "gemma2_softcap": lambda: build_model("gemma2").double(),
    "peft_lora": _lora_llama,
    "auto_class": lambda: transformers.AutoModelForCausalLM.from_config(
        tiny_config("llama")).double().train(),
}


class _Counter:
    def __init__(self, fn):
        self.fn, self.n = fn, 0

    def __call__(self, *a, **k):
        self.n += 1
        return self.fn(*a, **k)


@pytest.mark.parametrize("capture", [True, False])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_patched_model_steps_aside_while_capturing(name, capture, monkeypatch):
    model = MODELS[name]()
    stock = reference_copy(model)
    if name == "auto_class":
        from fused_ce_patch import AutoFusedCEForCausalLM

        torch.manual_seed(0)
        model = AutoFusedCEForCausalLM.from_config(tiny_config("llama"),
                                                  fused_ce_backend="torch").double().train()
        model.load_state_dict(stock.state_dict())
    else:
        apply_fused_ce(model, backend="torch")
    b = _batch(stock.config.vocab_size)
    counter = _Counter(fused_loss._check_labels_and_num_items)
    monkeypatch.setattr(fused_loss, "_check_labels_and_num_items", counter)
    want = stock(**b).loss
    if capture:
        _capture(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model(**b).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    if capture:
        assert counter.n == 0
        assert any("CUDA graph" in str(w.message) for w in caught), [str(w.message)
                                                                      for w in caught]
    else:
        assert counter.n >= 1


def test_tensor_logit_scale_no_host_read_while_capturing(monkeypatch):
    model = _tiny("cohere", transformers.CohereForCausalLM)
    model.logit_scale = torch.tensor(0.25, dtype=torch.float64)  # a 0-d tensor, no grad
    stock = copy.deepcopy(model)
    stock.loss_function = loss_mapping.original_causal_lm_loss()
    apply_fused_ce(model, backend="torch")
    b = _batch(model.config.vocab_size)
    reads = []
    item = torch.Tensor.item

    def recording_item(self):
        frames = [f for f in traceback.extract_stack() if "fused_ce_patch" in f.filename]
        if frames:
            reads.append(f"{frames[-1].name}:{frames[-1].lineno}")
        return item(self)

    want = stock(**b).loss
    _capture(monkeypatch)
    monkeypatch.setattr(torch.Tensor, "item", recording_item)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = model(**b).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert reads == [], f"host reads by fused_ce_patch during the capture: {reads}"

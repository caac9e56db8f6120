"""The use_fused_ce flag, whose refusal check runs apply_fused_ce's head check, still patches PEFT
LoRA on lm_head, modules_to_save, a RoBERTa transform head, a tied head, accelerate hooks from
dispatch_model on CPU; a model with an offloaded (meta) head gets the flag's warning and trains
stock. Found or checked by an adversarial pass (2026-12-05).
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from transformers import Trainer

from fused_ce_patch import FusedCETrainingArguments, is_fused_ce_applied
from fused_ce_patch.hf.tiny import tiny_config
from hf_helpers import build_model


def _lora(**kw):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(build_model("llama"), peft.LoraConfig(r=4, **kw))


def _roberta():
    config = tiny_config("roberta")
    config.is_decoder = True
    return transformers.RobertaForCausalLM(config).train()


def _dispatched():
    accelerate = pytest.importorskip("accelerate")
    model = build_model("llama")
    return accelerate.dispatch_model(model, device_map={"": "cpu"})


def _offloaded():
    accelerate = pytest.importorskip("accelerate")
    return accelerate.cpu_offload(build_model("llama"), execution_device=torch.device("cpu"))


ACCEPTED = {
    "lora_lm_head": lambda: _lora(target_modules=["lm_head", "q_proj"]),
    "modules_to_save": lambda: _lora(target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "roberta": _roberta,
    "tied": lambda: build_model("qwen2"),
    "dispatch_model_cpu": _dispatched,
}


def _trainer(model, tmp_path, caplog):
    args = FusedCETrainingArguments(output_dir=str(tmp_path), use_fused_ce=True,
                                    fused_ce_backend="torch", report_to=[], use_cpu=True)
    with caplog.at_level(logging.WARNING, logger="fused_ce_patch"):
        return Trainer(model=model, args=args)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_flag_still_patches(name, tmp_path, caplog):
    model = ACCEPTED[name]()
    _trainer(model, tmp_path, caplog)
    assert is_fused_ce_applied(model), [r.getMessage() for r in caplog.records]


def test_flag_refuses_offloaded_head(tmp_path):
    # Trainer itself cannot take a cpu_offload model on CPU (stock's .to() of meta tensors),
    # so the flag's refusal check is asked directly: a reason, not an exception
    from fused_ce_patch.hf.trainer import _refusal

    reason = _refusal(_offloaded())
    assert reason is not None and "meta" in reason, reason

"""The use_fused_ce flag's refusal check (``trainer._refusal``) refuses what apply_fused_ce's
head check refuses (a hook on lm_head, an nn.Linear subclass head) as it refuses everything
else: one warning, and a Trainer that trains the model stock. Found by an adversarial pass
(2026-12-05): such a model made ``Trainer(...)`` raise.
"""

import logging

import pytest
import torch
from transformers import Trainer

from fused_ce_patch import FusedCETrainingArguments, is_fused_ce_applied
from hf_helpers import build_model


class _MyLinear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x)


def _hooked():
    model = build_model("llama")
    model.lm_head.register_forward_hook(lambda *a: None)
    return model


def _subclass_head():
    model = build_model("llama")
    old = model.lm_head
    model.lm_head = _MyLinear(old.in_features, old.out_features, bias=False)
    model.lm_head.weight = old.weight
    return model


@pytest.mark.parametrize("make", [_hooked, _subclass_head], ids=["forward-hook", "subclass"])
def test_flag_warns_and_trains_stock(make, tmp_path, caplog):
    model = make()
    args = FusedCETrainingArguments(output_dir=str(tmp_path), use_fused_ce=True,
                                    fused_ce_backend="torch", report_to=[], use_cpu=True)
    with caplog.at_level(logging.WARNING, logger="fused_ce_patch"):
        Trainer(model=model, args=args)
    assert not is_fused_ce_applied(model)
    assert any("use_fused_ce" in r.getMessage() for r in caplog.records)

"""The process-wide opt-in ``apply_fused_ce_to_loss_mapping()`` (issue 23 §1).

Every ``LOSS_MAPPING`` alias of ``ForCausalLMLoss`` computes the same loss and gradient through
the chunked logits loss; Trainer's label counting still sees ``ForCausalLMLoss``;
``revert_fused_ce()`` restores every entry and name by identity. The autouse fixture of
conftest.py checks after every test that the mapping is transformers' own again.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
import transformers.loss.loss_utils as loss_utils

from fused_ce_patch import apply_fused_ce_to_loss_mapping, revert_fused_ce
from fused_ce_patch.hf import loss_mapping

from hf_helpers import LOSS_RTOL, assert_close_rel, assert_grads_close, batch, build_model


def _aliases():
    return sorted(k for k, v in loss_utils.LOSS_MAPPING.items()
                  if v is loss_utils.ForCausalLMLoss)


def test_every_alias_and_name_is_replaced_and_restored():
    import transformers.trainer as trainer_module

    aliases = _aliases()
    assert "ForCausalLM" in aliases and "ForConditionalGeneration" in aliases
    original = loss_utils.ForCausalLMLoss
    before = dict(loss_utils.LOSS_MAPPING)
    apply_fused_ce_to_loss_mapping()
    apply_fused_ce_to_loss_mapping()  # idempotent
    routed = loss_mapping.ForCausalLMLoss
    assert all(loss_utils.LOSS_MAPPING[k] is routed for k in aliases)
    assert all(loss_utils.LOSS_MAPPING[k] is v for k, v in before.items() if k not in aliases)
    assert loss_utils.ForCausalLMLoss is routed and trainer_module.ForCausalLMLoss is routed
    revert_fused_ce()
    assert loss_utils.ForCausalLMLoss is original and trainer_module.ForCausalLMLoss is original
    assert all(loss_utils.LOSS_MAPPING[k] is v for k, v in before.items())
    assert not loss_mapping.loss_mapping_patched()


def test_trainer_still_counts_shifted_labels(tmp_path):
    """Trainer counts ``labels[..., 1:]`` for ``num_items_in_batch`` when
    ``LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss`` (the name in transformers.trainer)."""
    from transformers import Trainer, TrainingArguments

    model = build_model("llama")
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    assert Trainer(model=model, args=args)._loss_shifts_labels  # stock
    apply_fused_ce_to_loss_mapping()
    assert Trainer(model=model, args=args)._loss_shifts_labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["mean", "num_items", "shift_labels", "ignore_index",
                                  "all_ignored"])
def test_unpatched_model_gets_the_same_loss_through_the_mapping(dtype, case, logits_loss_spy):
    model = build_model("llama").to(dtype)
    ref = copy.deepcopy(model)
    b = batch()
    kw = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
          "labels": b["labels"]}
    if case == "num_items":
        kw["num_items_in_batch"] = torch.tensor(17)
    elif case == "shift_labels":
        other = torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[..., 1:].contiguous()
        kw["shift_labels"] = other
    elif case == "ignore_index":
        kw["ignore_index"] = 5
        kw["labels"] = torch.where(b["labels"] < 0, 5, b["labels"])
    elif case == "all_ignored":
        kw["labels"] = torch.full_like(b["labels"], -100)
    want = ref(**kw)
    assert logits_loss_spy.count == 0
    apply_fused_ce_to_loss_mapping()
    got = model(**kw)
    assert logits_loss_spy.count == 1  # through the mapping, on an unpatched model
    if case == "all_ignored":
        assert torch.isnan(want.loss) and torch.isnan(got.loss)
        return
    assert_close_rel(got.loss, want.loss, LOSS_RTOL if dtype == torch.float32 else 1e-3, "loss")
    got.loss.backward()
    want.loss.backward()
    assert_grads_close(model, ref, rtol=1e-4 if dtype == torch.float32 else 2e-2)


def test_label_outside_the_vocabulary_raises_the_stock_exception_type():
    model = build_model("llama")
    b = batch()
    labels = b["labels"].clone()
    labels[0, 3] = model.config.vocab_size + 4
    try:
        model(input_ids=b["input_ids"], labels=labels)
    except Exception as exc:  # noqa: BLE001 - what stock raises is what we compare against
        stock_type = type(exc)
    else:
        pytest.fail("stock accepted a label >= V")
    apply_fused_ce_to_loss_mapping()
    with pytest.raises(stock_type):
        model(input_ids=b["input_ids"], labels=labels)


def test_patched_models_keep_the_fused_path_under_the_opt_in(spy):
    from fused_ce_patch import apply_fused_ce

    apply_fused_ce_to_loss_mapping()
    model = build_model("llama")
    apply_fused_ce(model)
    model(**batch()).loss.backward()
    assert spy.count == 1  # the re-registered loss counts as the causal-LM loss in force


def test_never_patched_model_after_revert_is_stock(logits_loss_spy):
    apply_fused_ce_to_loss_mapping()
    revert_fused_ce()
    model = build_model("llama")
    model(**batch()).loss.backward()
    assert logits_loss_spy.count == 0
    assert transformers.LlamaForCausalLM(model.config).loss_function is loss_utils.ForCausalLMLoss

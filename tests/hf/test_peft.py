"""PEFT: LoRA on the body, lm_head in modules_to_save, LoRA on lm_head, and refusals."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from fused_ce_patch import UnsupportedModelError, apply_fused_ce, revert_fused_ce  # noqa: E402
from fused_ce_patch.hf.patch import is_fused_ce_applied  # noqa: E402
from fused_ce_patch.hf.sentinel import NotMaterializedLogits  # noqa: E402
from hf_helpers import (  # noqa: E402
    LOSS_RTOL,
    assert_close_rel,
    assert_grads_close,
    batch,
    build_model,
    compare_with_stock,
    reference_copy,
)


def peft_pair(arch, apply_first=False, seed=0, **lora):
    """A PEFT model patched with apply_fused_ce and an unpatched copy with equal weights."""
    torch.manual_seed(seed)
    base = build_model(arch)
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora)
    if apply_first:  # patching the base before get_peft_model works the same
        ref = reference_copy(get_peft_model(build_model(arch), cfg))
        apply_fused_ce(base)
        model = get_peft_model(base, cfg)
        ref.load_state_dict(model.state_dict())
    else:
        model = get_peft_model(base, cfg)
        ref = reference_copy(model)
        apply_fused_ce(model)
    model.train()
    ref.train()
    return model, ref


def run_pair(model, ref, spy, seed=0):
    b = batch()
    torch.manual_seed(seed)  # same dropout masks in both
    want = ref(**b)
    assert spy.count == 0
    torch.manual_seed(seed)
    got = model(**b)
    assert spy.count == 1 and isinstance(got.logits, NotMaterializedLogits)
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss")
    got.loss.backward()
    want.loss.backward()
    assert_grads_close(model, ref)
    return got


@pytest.mark.parametrize("apply_first", [False, True])
def test_lora_on_attention_and_mlp(apply_first, spy):
    model, ref = peft_pair("llama", apply_first=apply_first,
                           target_modules=["q_proj", "v_proj", "up_proj"])
    assert is_fused_ce_applied(model)
    run_pair(model, ref, spy)
    assert spy.calls[0]["weight"] is model.get_base_model().lm_head.weight
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_lm_head_in_modules_to_save(spy):
    model, ref = peft_pair("llama", target_modules=["q_proj"], modules_to_save=["lm_head"])
    head = model.get_base_model().lm_head
    trained = head.modules_to_save["default"]
    run_pair(model, ref, spy)
    assert spy.calls[0]["weight"] is trained.weight  # the trainable copy, not the original
    assert trained.weight.grad is not None and trained.weight.grad.any()
    assert head.original_module.weight.grad is None


def test_modules_to_save_with_adapter_disabled(spy):
    model, ref = peft_pair("llama", target_modules=["q_proj"], modules_to_save=["lm_head"])
    head = model.get_base_model().lm_head
    b = batch()
    with ref.disable_adapter():
        want = ref(**b)
    with model.disable_adapter():
        got = model(**b)
    assert spy.count == 1 and spy.calls[0]["weight"] is head.original_module.weight
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss")


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_lora_on_lm_head_is_included_exactly(dropout, spy):
    model, ref = peft_pair("gemma2", target_modules=["q_proj", "lm_head"], lora_dropout=dropout)
    head = model.get_base_model().lm_head
    run_pair(model, ref, spy)
    r = head.lora_A["default"].weight.shape[0]
    call = spy.calls[0]
    assert call["weight"].shape[1] == head.base_layer.weight.shape[1] + r  # [W | B]
    for part in (head.lora_A["default"].weight, head.lora_B["default"].weight):
        assert part.grad is not None and part.grad.any()


def test_lora_on_lm_head_disabled_and_merged(spy):
    model, ref = peft_pair("llama", target_modules=["lm_head"])
    b = batch()
    with ref.disable_adapter():
        want = ref(**b)
    with model.disable_adapter():
        got = model(**b)
    assert spy.calls[-1]["weight"] is model.get_base_model().lm_head.base_layer.weight
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss (disabled)")
    model.merge_adapter()
    ref.merge_adapter()
    assert_close_rel(model(**b).loss, ref(**b).loss, LOSS_RTOL, "loss (merged)")


def test_lora_bias_on_lm_head(spy):
    model, ref = peft_pair("llama", target_modules=["lm_head"], lora_bias=True)
    run_pair(model, ref, spy)
    assert spy.calls[0]["bias"] is not None


def test_tied_qwen2_with_lora(spy):
    model, ref = peft_pair("qwen2", target_modules=["q_proj", "gate_proj"])
    base = model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight
    run_pair(model, ref, spy)


def test_dora_on_lm_head_is_refused_at_apply_time():
    torch.manual_seed(0)
    model = get_peft_model(build_model("llama"),
                           LoraConfig(r=4, target_modules=["lm_head"], use_dora=True))
    with pytest.raises(UnsupportedModelError, match="DoRA|variant"):
        apply_fused_ce(model)
    assert not is_fused_ce_applied(model)


def test_dora_added_after_apply_takes_the_stock_computation(spy):
    """DoRA on the head is known only at call time: that call computes as stock (real logits,
    one warning), never a loss without the adapter."""
    base = build_model("llama")
    apply_fused_ce(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["lm_head"], use_dora=True,
                                            init_lora_weights=False))
    ref = reference_copy(model)
    with pytest.warns(RuntimeWarning, match="DoRA|variant"):
        compare_with_stock(model, ref, batch(), False, spy)


def test_revert_through_peft_wrapper():
    model, _ = peft_pair("llama", target_modules=["q_proj"])
    revert_fused_ce(model)
    assert "forward" not in model.get_base_model().__dict__

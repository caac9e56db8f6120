"""apply_fused_ce / revert_fused_ce / apply_fused_ce_to_<arch>: scope, idempotence, exact undo."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import fused_ce_patch
from fused_ce_patch import (
    UnsupportedModelError,
    apply_fused_ce,
    apply_fused_ce_to_gemma2,
    apply_fused_ce_to_gemma3,
    apply_fused_ce_to_llama,
    apply_fused_ce_to_mistral,
    apply_fused_ce_to_qwen2,
    revert_fused_ce,
)
from fused_ce_patch.hf.architectures import ARCHITECTURES
from fused_ce_patch.hf.patch import is_fused_ce_applied
from fused_ce_patch.hf.registry import stock_forward_of
from fused_ce_patch.hf.sentinel import NotMaterializedLogits
from hf_helpers import LOSS_RTOL, assert_close_rel, batch, build_model, reference_copy

CLASS_PATCHERS = {
    "llama": apply_fused_ce_to_llama,
    "qwen2": apply_fused_ce_to_qwen2,
    "mistral": apply_fused_ce_to_mistral,
    "gemma2": apply_fused_ce_to_gemma2,
    "gemma3_text": apply_fused_ce_to_gemma3,
}


def test_public_names_resolve():
    for name in fused_ce_patch._LAZY:
        assert getattr(fused_ce_patch, name) is not None, name


def test_apply_twice_is_a_noop_and_revert_restores_exact_objects():
    model = build_model("llama")
    before = dict(model.__dict__)
    assert apply_fused_ce(model) is model
    installed = model.__dict__["forward"]
    apply_fused_ce(model)
    assert model.__dict__["forward"] is installed
    apply_fused_ce(model, logits_budget=2**20)  # new options, same objects
    assert model.__dict__["forward"] is installed
    assert model._fused_ce_state.options.logits_budget == 2**20
    assert revert_fused_ce(model) is model
    assert model.__dict__.keys() == before.keys()
    assert all(model.__dict__[k] is v for k, v in before.items())
    revert_fused_ce(model)  # reverting again is a no-op
    assert not is_fused_ce_applied(model)


def test_other_instances_are_left_alone(spy):
    model = build_model("llama")
    other = build_model("llama", seed=1)
    apply_fused_ce(model)
    assert "forward" not in other.__dict__
    assert type(other).forward is type(model).forward  # the class is untouched
    assert isinstance(other(**batch()).logits, torch.Tensor) and spy.count == 0
    assert isinstance(model(**batch()).logits, NotMaterializedLogits) and spy.count == 1


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_class_level_patch_and_revert(arch, spy):
    cls = ARCHITECTURES[arch].model_class()
    stock = cls.__dict__["forward"]
    assert CLASS_PATCHERS[arch]() is None
    CLASS_PATCHERS[arch]()  # twice: no-op
    patched = cls.__dict__["forward"]
    assert patched is not stock and stock_forward_of(patched) is stock
    assert inspect.signature(patched) == inspect.signature(stock)
    model = build_model(arch)  # built after the patch
    ref = reference_copy(model)
    ref.forward = stock.__get__(ref)  # an unpatched reference despite the class patch
    b = batch()
    want = ref(**b)
    assert spy.count == 0
    got = model(**b)
    assert spy.count == 1 and isinstance(got.logits, NotMaterializedLogits)
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss")
    assert is_fused_ce_applied(cls) and is_fused_ce_applied(model)
    revert_fused_ce(cls)
    assert cls.__dict__["forward"] is stock
    assert isinstance(model(**b).logits, torch.Tensor) and spy.count == 1


def test_instance_options_override_class_patch(spy):
    apply_fused_ce_to_llama()
    model = build_model("llama")
    apply_fused_ce(model, return_logits=True)
    assert isinstance(model(**batch()).logits, torch.Tensor) and spy.count == 0
    revert_fused_ce(model)
    assert isinstance(model(**batch()).logits, NotMaterializedLogits)  # class patch again


def test_class_patcher_with_instance(spy):
    model = build_model("qwen2")
    assert apply_fused_ce_to_qwen2(model) is model
    assert "forward" in model.__dict__
    with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM"):
        apply_fused_ce_to_llama(model)


def test_unsupported_model_type():
    # XLM computes its loss inside its prediction layer (`self.pred_layer(output, labels)`),
    # with no head call and loss call to rewrite: refused by the derivation.
    from transformers import XLMConfig, XLMWithLMHeadModel

    model = XLMWithLMHeadModel(XLMConfig(n_layers=1, emb_dim=16, n_heads=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError) as info:
        apply_fused_ce(model)
    assert isinstance(info.value, ValueError)
    for name in ARCHITECTURES:
        assert repr(name) in str(info.value)
    assert "forward" not in model.__dict__


def test_non_causal_lm_class_of_supported_type():
    from transformers import LlamaForSequenceClassification

    from hf_helpers import tiny_config

    model = LlamaForSequenceClassification(tiny_config("llama"))
    with pytest.raises(UnsupportedModelError):
        apply_fused_ce(model)


def test_subclass_overriding_forward_is_refused():
    from transformers import LlamaForCausalLM

    from hf_helpers import tiny_config

    class Custom(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    with pytest.raises(UnsupportedModelError, match="overrides"):
        apply_fused_ce(Custom(tiny_config("llama")))


def test_foreign_instance_forward_is_refused():
    model = build_model("llama")
    model.forward = lambda *a, **k: None
    with pytest.raises(UnsupportedModelError, match="replaced"):
        apply_fused_ce(model)


def test_bad_options():
    model = build_model("llama")
    with pytest.raises(ValueError, match="backend"):
        apply_fused_ce(model, backend="cuda-magic")
    with pytest.raises(ValueError, match="logits_budget"):
        apply_fused_ce(model, logits_budget=-1)
    assert not is_fused_ce_applied(model)


def test_options_reach_the_loss(spy):
    model = build_model("llama")
    apply_fused_ce(model, backend="reference", logits_budget=4096)
    model(**batch())
    assert spy.calls[0]["backend"] == "reference" and spy.calls[0]["logits_budget"] == 4096


def test_compiled_wrapper_is_looked_through():
    model = build_model("llama")
    compiled = torch.compile(model)  # not run: only the wrapper matters here
    apply_fused_ce(compiled)
    assert is_fused_ce_applied(model) and "forward" in model.__dict__
    revert_fused_ce(compiled)
    assert "forward" not in model.__dict__


def _bf16_accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    return Accelerator(cpu=True, mixed_precision="bf16")


@pytest.mark.parametrize("order", ["apply_then_prepare", "prepare_then_apply"])
def test_accelerate_prepared_model(order, spy):
    from accelerate.state import AcceleratorState

    model = build_model("llama")
    ref = reference_copy(model)
    accelerator = _bf16_accelerator()
    try:
        if order == "apply_then_prepare":
            apply_fused_ce(model)
            model = accelerator.prepare(model)
        else:
            model = accelerator.prepare(model)
            prepared_forward = model.__dict__["forward"]
            apply_fused_ce(model)
            assert model.__dict__["forward"] is not prepared_forward
        b = batch()
        out = model(**b)
        assert spy.count == 1
        call = spy.calls[0]
        assert call["autocast"] and call["autocast_dtype"] == torch.bfloat16  # AMP kept
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = ref(**b)
        assert_close_rel(out.loss, want.loss.float(), 2e-2, "bf16 loss")
        out.loss.backward()
        assert model.lm_head.weight.grad is not None

        revert_fused_ce(model)
        if order == "prepare_then_apply":
            assert model.__dict__["forward"] is prepared_forward  # accelerate's own object
        out = model(**b)
        assert spy.count == 1 and isinstance(out.logits, torch.Tensor)
        apply_fused_ce(model)  # and again
        assert isinstance(model(**b).logits, NotMaterializedLogits) and spy.count == 2
    finally:
        AcceleratorState._reset_state(True)


def test_lazy_map_points_at_hf_modules():
    for name, module in fused_ce_patch._LAZY.items():
        assert hasattr(importlib.import_module(module), name)


def test_accelerate_dispatch_hook(spy):
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class CountingHook(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            CountingHook.calls += 1
            return args, kwargs

    model = build_model("llama")
    ref = reference_copy(model)
    add_hook_to_module(model, CountingHook())
    hooked_forward, saved = model.__dict__["forward"], model.__dict__["_old_forward"]
    apply_fused_ce(model)
    assert model.__dict__["forward"] is hooked_forward  # the hook wrapper stays outermost
    b = batch()
    got, want = model(**b), ref(**b)
    assert spy.count == 1 and CountingHook.calls == 1
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss")
    revert_fused_ce(model)
    assert model.__dict__["_old_forward"] is saved
    remove_hook_from_module(model)
    assert isinstance(model(**b).logits, torch.Tensor) and spy.count == 1


def test_deepcopy_of_patched_model(spy):
    import copy

    model = build_model("llama")
    apply_fused_ce(model)
    clone = copy.deepcopy(model)
    assert clone.__dict__["forward"].__self__ is clone
    assert isinstance(clone(**batch()).logits, NotMaterializedLogits) and spy.count == 1
    revert_fused_ce(clone)
    assert "forward" not in clone.__dict__ and "forward" in model.__dict__
    assert isinstance(clone(**batch()).logits, torch.Tensor) and spy.count == 1


def test_pickled_patched_model_comes_back_unpatched_and_can_be_patched(spy):
    import pickle

    from fused_ce_patch.hf.patch import is_fused_ce_applied

    model = build_model("llama")
    apply_fused_ce(model)
    clone = pickle.loads(pickle.dumps(model))
    # pickle cannot carry the patched forward: the copy must say it is unpatched...
    assert not is_fused_ce_applied(clone)
    assert isinstance(clone(**batch()).logits, torch.Tensor) and spy.count == 0
    # ...and patching it again must work and take the fused path.
    apply_fused_ce(clone)
    assert isinstance(clone(**batch()).logits, NotMaterializedLogits) and spy.count == 1
    revert_fused_ce(clone)
    assert isinstance(clone(**batch()).logits, torch.Tensor) and spy.count == 1

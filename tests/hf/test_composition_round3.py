"""Compositions from the third adversarial pass (issue 38): Trainer subclasses under the flag,
tensor-subclass head weights, autograd modes, accelerate's unwrap, class scope and stock's
exception types. Each test runs stock beside the patched model and wants stock's number,
stock's path, or a clear refusal at apply time."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import Trainer, TrainingArguments

from fused_ce_patch import FusedCETrainingArguments
from hf_helpers import LOSS_RTOL, assert_close_rel, build_model, reference_copy
from test_trainer import ListDataset, logged_losses, make_dataset


def _args(cls, out, **extra):
    return cls(output_dir=str(out), per_device_train_batch_size=2, per_device_eval_batch_size=2,
               max_steps=2, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
               weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, report_to=[],
               use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0, **extra)


# -- 38.2: Trainer subclasses that override compute_loss, under the flag ---------------------


class PenaltyTrainer(Trainer):
    """Adds a penalty read from outputs.logits (a z-loss-like term)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        loss = out.loss + 1e-3 * out.logits.float().pow(2).mean()
        return (loss, out) if return_outputs else loss


class WeightedTrainer(Trainer):
    """Pops the labels and computes its own weighted token loss from the logits."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        out = model(**inputs)
        per_token = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].float().transpose(1, 2), labels[:, 1:], reduction="none")
        weights = torch.linspace(0.5, 1.5, per_token.shape[-1])
        loss = (per_token * weights).sum() / (labels[:, 1:] != -100).sum().clamp(min=1)
        return (loss, out) if return_outputs else loss


def _run(cls, args_cls, out, **flag):
    trainer = cls(model=build_model("llama"),
                  args=_args(args_cls, out, eval_strategy="steps", eval_steps=1, **flag),
                  train_dataset=make_dataset(), eval_dataset=make_dataset())
    trainer.train()
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    return logged_losses(trainer), torch.tensor(evals), trainer.evaluate()["eval_loss"]


@pytest.mark.parametrize("cls", [PenaltyTrainer, WeightedTrainer])
def test_flag_with_a_compute_loss_subclass_trains_and_evaluates_as_stock(cls, tmp_path, caplog):
    want = _run(cls, TrainingArguments, tmp_path / "s")
    with caplog.at_level(logging.WARNING, logger="fused_ce_patch"):
        got = _run(cls, FusedCETrainingArguments, tmp_path / "f", use_fused_ce=True)
    assert got[1].numel() == 2  # evaluation ran at both steps (training went on)
    assert_close_rel(got[0], want[0], LOSS_RTOL, "train losses")
    assert_close_rel(got[1], want[1], LOSS_RTOL, "eval losses during training")
    assert abs(got[2] - want[2]) <= LOSS_RTOL * abs(want[2])
    said = [r for r in caplog.records if "overrides compute_loss" in r.getMessage()]
    assert len(said) == 1 and cls.__name__ in said[0].getMessage()  # says so once


def test_flag_with_stock_compute_loss_keeps_the_fused_path(tmp_path, spy, caplog):
    class Plain(Trainer):  # a subclass that leaves compute_loss alone: fused, no warning
        pass

    with caplog.at_level(logging.WARNING, logger="fused_ce_patch"):
        got = _run(Plain, FusedCETrainingArguments, tmp_path / "f", use_fused_ce=True)
    want = _run(Plain, TrainingArguments, tmp_path / "s")
    assert spy.count >= 2 and "overrides compute_loss" not in caplog.text
    assert_close_rel(got[0], want[0], LOSS_RTOL, "train losses")


class RecordingTrainer(Trainer):
    """Records what it sees and delegates to Trainer's loss: reads only outputs.loss."""

    seen = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        RecordingTrainer.seen += 1
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


def test_trusted_compute_loss_subclass_keeps_the_fused_path(tmp_path, spy, caplog):
    # fused_ce_trust_compute_loss=True: the user says the override reads only outputs.loss
    want = _run(RecordingTrainer, TrainingArguments, tmp_path / "s")
    with caplog.at_level(logging.WARNING, logger="fused_ce_patch"):
        got = _run(RecordingTrainer, FusedCETrainingArguments, tmp_path / "f",
                   use_fused_ce=True, fused_ce_trust_compute_loss=True)
    assert spy.count >= 2 and "overrides compute_loss" not in caplog.text
    assert RecordingTrainer.seen > 0
    assert_close_rel(got[0], want[0], LOSS_RTOL, "train losses")
    assert_close_rel(got[1], want[1], LOSS_RTOL, "eval losses during training")
    assert abs(got[2] - want[2]) <= LOSS_RTOL * abs(want[2])
    with pytest.raises(TypeError, match="fused_ce_trust_compute_loss"):
        FusedCETrainingArguments(output_dir=str(tmp_path), fused_ce_trust_compute_loss="yes")


def test_flag_eval_with_only_shift_labels_is_stock(tmp_path):
    # stock computes no loss from shift_labels alone; the flag must not ask for a loss-only
    # forward there (skip_logits=True needs labels)
    rows = [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"],
             "shift_labels": torch.cat([r["labels"][1:], r["labels"].new_tensor([-100])])}
            for r in make_dataset().rows]
    ds = ListDataset(rows)

    def run(args_cls, out, **flag):
        trainer = Trainer(model=build_model("llama"), eval_dataset=ds,
                          args=_args(args_cls, out, remove_unused_columns=False, **flag))
        return trainer.evaluate()

    want = run(TrainingArguments, tmp_path / "s")
    got = run(FusedCETrainingArguments, tmp_path / "f", use_fused_ce=True)
    assert sorted(k for k in got if "runtime" not in k and "per_second" not in k) == \
        sorted(k for k in want if "runtime" not in k and "per_second" not in k)
    if "eval_loss" in want:
        assert abs(got["eval_loss"] - want["eval_loss"]) <= LOSS_RTOL * abs(want["eval_loss"])


# -- 38.3: a head weight whose type runs its own F.linear --------------------------------------


class FakeQuantParameter(torch.nn.Parameter):
    """QAT-style fake quantisation: F.linear sees the weight rounded to steps of 1/16
    (straight-through gradient); every other torch function sees the stored values."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.nn.functional.linear:
                x, w, *rest = args
                w = w + (torch.round(w * 16) / 16 - w).detach()
                return func(x, w, *rest, **kwargs)
            return func(*args, **kwargs)


def _fake_quant_head(model):
    head = model.get_output_embeddings()
    head.weight = FakeQuantParameter(head.weight.detach().clone() * 8)  # coarse steps matter


def test_fake_quant_head_weight_is_refused_at_apply():
    from fused_ce_patch import UnsupportedModelError, apply_fused_ce

    model = build_model("qwen2")  # untied head
    _fake_quant_head(model)
    with pytest.raises(UnsupportedModelError, match="__torch_function__"):
        apply_fused_ce(model)


def test_fake_quant_head_weight_set_after_apply_takes_the_stock_path(spy):
    from fused_ce_patch import apply_fused_ce
    from hf_helpers import batch, compare_with_stock

    model = apply_fused_ce(build_model("qwen2"))
    ref = reference_copy(model)
    _fake_quant_head(model)
    _fake_quant_head(ref)
    model.train()
    ref.train()
    with pytest.warns(RuntimeWarning, match="__torch_function__"):
        compare_with_stock(model, ref, batch(), fused=False, spy=spy)


def test_plain_sharded_and_library_parameters_are_not_custom():
    from torch.distributed.tensor import DTensor

    from fused_ce_patch.hf.head import custom_torch_function

    w = torch.nn.Parameter(torch.zeros(2, 2))
    assert custom_torch_function(w) == "" and custom_torch_function(w.detach()) == ""
    assert custom_torch_function(None) == ""
    assert DTensor.__torch_function__ is torch._C._disabled_torch_function_impl
    try:
        from torch.distributed.fsdp._flat_param import FlatParameter
    except ImportError:
        FlatParameter = None
    if FlatParameter is not None:
        assert FlatParameter.__torch_function__ is torch._C._disabled_torch_function_impl
    assert custom_torch_function(FakeQuantParameter(torch.zeros(2, 2))).endswith(
        "FakeQuantParameter")


# -- 38.4: apply_fused_ce_to_loss_mapping is all or nothing ------------------------------------


def _mapping_is_stock():
    import transformers.loss.loss_utils as loss_utils

    from fused_ce_patch.hf import loss_mapping

    stock = loss_mapping.original_causal_lm_loss()
    return loss_utils.ForCausalLMLoss is stock and all(
        fn is not loss_mapping.ForCausalLMLoss for fn in loss_utils.LOSS_MAPPING.values())


def test_loss_mapping_opt_in_failing_part_way_rolls_back(monkeypatch):
    import transformers.loss.loss_utils as loss_utils

    from fused_ce_patch.hf import loss_mapping

    real = loss_mapping._replace
    calls = []

    def fail_on_third(namespace, key, original):
        calls.append(key)
        if len(calls) == 3:
            raise ModuleNotFoundError("No module named 'torchvision'")
        real(namespace, key, original)

    monkeypatch.setattr(loss_mapping, "_replace", fail_on_third)
    with pytest.raises(RuntimeError, match="all were restored") as info:
        loss_mapping.apply_fused_ce_to_loss_mapping()
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert len(calls) == 3 and _mapping_is_stock() and not loss_mapping.loss_mapping_patched()
    monkeypatch.setattr(loss_mapping, "_replace", real)
    loss_mapping.apply_fused_ce_to_loss_mapping()  # a second call really applies
    assert loss_mapping.loss_mapping_patched()
    assert loss_utils.LOSS_MAPPING["ForCausalLM"] is loss_mapping.ForCausalLMLoss


def test_loss_mapping_opt_in_does_not_import_lazy_modules(monkeypatch):
    # transformers' lazy modules import a submodule to answer getattr; without an optional
    # dependency (torchvision) that raises ModuleNotFoundError (5.17)
    import sys
    import types

    from fused_ce_patch.hf import loss_mapping

    class Lazy(types.ModuleType):
        def __getattr__(self, name):
            raise ModuleNotFoundError("No module named 'torchvision'")

    monkeypatch.setitem(sys.modules, "transformers.zz_lazy_probe",
                        Lazy("transformers.zz_lazy_probe"))
    monkeypatch.setitem(sys.modules, "transformers.zz_none_probe", None)  # a failed import
    loss_mapping.apply_fused_ce_to_loss_mapping()
    assert loss_mapping.loss_mapping_patched()
    loss_mapping.revert_loss_mapping()
    assert _mapping_is_stock()


# -- 38.6: forward-mode AD and batched gradients through the training loss --------------------


def _embeds_pair():
    from fused_ce_patch import apply_fused_ce
    from hf_helpers import batch

    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model)
    model.train()
    ref.train()
    kw = batch()
    emb = model.get_input_embeddings()(kw["input_ids"]).detach()
    return model, ref, kw, emb


def test_forward_mode_ad_through_the_training_loss_is_stock(spy):
    import torch.autograd.forward_ad as fwad

    model, ref, kw, emb = _embeds_pair()
    tangent = torch.randn(emb.shape, generator=torch.Generator().manual_seed(3))

    def jvp(m):
        with fwad.dual_level():
            out = m(inputs_embeds=fwad.make_dual(emb, tangent),
                    attention_mask=kw["attention_mask"], labels=kw["labels"])
            primal, tan = fwad.unpack_dual(out.loss)
            return primal.detach(), tan.detach()

    want = jvp(ref)
    with pytest.warns(RuntimeWarning, match="forward-mode AD"):
        got = jvp(model)
    assert spy.count == 0  # stock's computation from the head on
    assert_close_rel(got[0], want[0], LOSS_RTOL, "loss")
    assert_close_rel(got[1], want[1], LOSS_RTOL, "directional derivative")


def test_batched_upstream_gradients_through_the_training_loss_match_stock(spy):
    model, ref, kw, emb = _embeds_pair()
    scales = torch.tensor([1.0, -2.0, 0.5])  # one upstream gradient per batch entry

    def grads(m):
        e = emb.clone().requires_grad_()
        out = m(inputs_embeds=e, attention_mask=kw["attention_mask"], labels=kw["labels"])
        (g,) = torch.autograd.grad(out.loss, e, scales, is_grads_batched=True)
        return g

    want = grads(ref)
    got = grads(model)
    assert spy.count == 1  # the fused path, its backward linear in the upstream gradient
    assert got.shape == want.shape == (3, *emb.shape)
    for i in range(3):
        from hf_helpers import GRAD_RTOL

        assert_close_rel(got[i], want[i], GRAD_RTOL, f"batch entry {i}")


# -- 38.8: stock's types and non-finite semantics ----------------------------------------------


@pytest.mark.parametrize("upstream", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_upstream_gradient_gives_stocks_nan_pattern(upstream, spy):
    from fused_ce_patch import apply_fused_ce
    from hf_helpers import batch

    model = build_model("qwen2")  # untied head: lm_head.weight.grad is the head's alone
    ref = reference_copy(model)
    apply_fused_ce(model)
    model.train()
    ref.train()
    kw = batch()
    for m in (ref, model):
        m(**kw).loss.backward(torch.tensor(upstream))
    assert spy.count == 1
    for name, p in ref.named_parameters():
        got = dict(model.named_parameters())[name].grad
        want = p.grad
        if want is None:
            continue
        # NaN where stock has NaN, the same infinities where stock has them
        assert torch.equal(got.isnan(), want.isnan()), name
        assert torch.equal(got.isinf(), want.isinf()), name
        assert torch.equal(got[want.isinf()], want[want.isinf()]), name


# -- 38.7: accelerate's unwrap_model and the scope of a class patch ---------------------------


@pytest.mark.parametrize("order", ["patch_then_prepare", "prepare_then_patch"])
def test_unwrap_model_without_fp32_wrapper_keeps_the_patch(order, spy):
    # Trainer's save paths call unwrap_model(model, keep_fp32_wrapper=False); accelerate walks
    # __wrapped__ down from the prepared forward and binds what it finds
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from fused_ce_patch import apply_fused_ce
    from fused_ce_patch.hf.patch import is_fused_ce_applied
    from hf_helpers import batch, compare_with_stock

    model = build_model("llama")
    ref = reference_copy(model)
    AcceleratorState._reset_state(True)  # an earlier Trainer's state would fix the precision
    try:
        acc = Accelerator(mixed_precision="bf16", cpu=True)
        if order == "patch_then_prepare":
            prepared = acc.prepare(apply_fused_ce(model))
        else:
            prepared = apply_fused_ce(acc.prepare(model))
        unwrapped = acc.unwrap_model(prepared, keep_fp32_wrapper=False)
    finally:
        AcceleratorState._reset_state(True)
    assert "_original_forward" not in unwrapped.__dict__  # accelerate's wrapper is gone
    assert is_fused_ce_applied(unwrapped)
    unwrapped.train()
    ref.train()
    compare_with_stock(unwrapped, ref, batch(), True, spy)  # fp32 again, fused, stock's number


class UserLlama(__import__("transformers").LlamaForCausalLM):
    """A user's subclass that leaves forward alone."""


def test_class_patch_of_a_user_subclass_leaves_its_parent_stock(spy):
    import transformers

    from fused_ce_patch import apply_fused_ce_to_class, revert_fused_ce
    from fused_ce_patch.hf.patch import is_fused_ce_applied
    from hf_helpers import batch

    parent = transformers.LlamaForCausalLM
    stock = parent.__dict__["forward"]
    plain = build_model("llama")
    mine = UserLlama(plain.config)
    mine.load_state_dict(plain.state_dict())
    try:
        assert apply_fused_ce_to_class(UserLlama) is UserLlama
        assert parent.__dict__["forward"] is stock and not is_fused_ce_applied(parent)
        assert is_fused_ce_applied(UserLlama)
        plain.train()
        mine.train()
        plain(**batch())
        assert spy.count == 0  # an unrelated LlamaForCausalLM stays stock
        mine(**batch())
        assert spy.count == 1
    finally:
        revert_fused_ce(UserLlama)
    assert "forward" not in UserLlama.__dict__ and parent.__dict__["forward"] is stock
    mine(**batch())
    assert spy.count == 1


def test_reverting_a_subclass_patch_keeps_its_parents_class_patch(spy):
    import transformers

    from fused_ce_patch import apply_fused_ce_to_class, revert_fused_ce
    from hf_helpers import batch

    parent = transformers.LlamaForCausalLM
    plain = build_model("llama")
    try:
        apply_fused_ce_to_class(parent)
        apply_fused_ce_to_class(UserLlama)
        revert_fused_ce(UserLlama)
        plain.train()
        plain(**batch())
        assert spy.count == 1  # the parent's own patch still computes
    finally:
        revert_fused_ce(parent)


def _patched_pair(dtype=torch.float32):
    from fused_ce_patch import apply_fused_ce

    model = build_model("llama").to(dtype)
    ref = reference_copy(model)
    apply_fused_ce(model)
    model.train()
    ref.train()
    return model, ref


@pytest.mark.parametrize("kind", ["list", "numpy"])
def test_labels_that_are_not_tensors_raise_stocks_type_error(kind):
    from hf_helpers import batch

    model, ref = _patched_pair()
    kw = batch()
    labels = kw.pop("labels")
    labels = labels.tolist() if kind == "list" else labels.numpy()
    with pytest.raises(Exception) as stock:
        ref(**kw, labels=labels)
    with pytest.raises(type(stock.value), match="labels must be a torch.Tensor"):
        model(**kw, labels=labels)


def test_float64_model_training_loss_is_float32_as_stock(spy):
    from hf_helpers import batch

    model, ref = _patched_pair(torch.float64)
    want, got = ref(**batch()).loss, model(**batch()).loss
    assert spy.count == 1
    assert got.dtype == want.dtype == torch.float32
    # stock rounds the float64 logits to float32 first; the fused loss rounds once at the end
    assert_close_rel(got.double(), want.double(), LOSS_RTOL, "loss")
    got.backward()
    want.backward()
    from hf_helpers import assert_grads_close

    assert_grads_close(model, ref)


def test_num_items_in_batch_with_two_elements_fails_where_stock_fails(spy):
    from hf_helpers import batch

    model, ref = _patched_pair()
    n = torch.tensor([10, 12])
    want = ref(**batch(), num_items_in_batch=n).loss
    got = model(**batch(), num_items_in_batch=n).loss
    assert spy.count == 0 and got.shape == want.shape == (2,)  # stock's path, stock's loss
    assert_close_rel(got, want, LOSS_RTOL, "loss")
    with pytest.raises(RuntimeError) as stock:
        want.backward()
    with pytest.raises(type(stock.value)):
        got.backward()


# -- the final no-stake hunt (issue 38's closing review) --------------------------------------


def test_num_items_in_batch_requiring_grad_gets_stocks_gradient(spy):
    # The fused loss takes the count as a constant: a count that requires grad takes the
    # stock computation, which gives it its gradient (-sum / n**2).
    from hf_helpers import batch

    model, ref = _patched_pair()
    n_ref = torch.tensor(5.0, requires_grad=True)
    n_got = torch.tensor(5.0, requires_grad=True)
    ref(**batch(), num_items_in_batch=n_ref).loss.backward()
    model(**batch(), num_items_in_batch=n_got).loss.backward()
    assert spy.count == 0
    assert n_got.grad is not None
    assert_close_rel(n_got.grad, n_ref.grad, LOSS_RTOL, "num_items_in_batch.grad")
    # a detached count keeps the fused path
    model(**batch(), num_items_in_batch=n_got.detach()).loss.backward()
    assert spy.count == 1


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_double_backward_raises_naming_the_remedy_and_revert_computes_it(mode):
    from fused_ce_patch import revert_fused_ce
    from hf_helpers import batch

    model, ref = _patched_pair()
    getattr(model, mode)()
    getattr(ref, mode)()
    with pytest.raises(RuntimeError, match="double backward.*revert_fused_ce"):
        loss = model(**batch()).loss
        (g,) = torch.autograd.grad(loss, model.lm_head.weight, create_graph=True)
        g.pow(2).sum().backward()
    revert_fused_ce(model)
    model.zero_grad()
    for m in (model, ref):
        (g,) = torch.autograd.grad(m(**batch()).loss, m.lm_head.weight, create_graph=True)
        g.pow(2).sum().backward()
    from hf_helpers import assert_grads_close

    assert_grads_close(model, ref)

"""Composition: the patch combined with other code that changes what the stock model computes.

Principle (design.md §5, "the live model is the reference"): the fused path runs only when it
computes what the live stock forward would compute at that call; otherwise the call runs the
stock forward (one RuntimeWarning naming the reason), or ``apply_fused_ce`` refuses when that
is knowable then. Each test builds the composed stock model and the composed patched model
from the same weights and compares loss and every gradient (hf_helpers tolerances), after a
spy has shown which path the patched model took.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import transformers
from torch import nn

from fused_ce_patch import apply_fused_ce, is_fused_ce_applied, revert_fused_ce
from fused_ce_patch.errors import UnsupportedModelError

from hf_helpers import (
    LOSS_RTOL,
    assert_close_rel,
    batch,
    build_model,
    compare_with_stock,
    reference_copy,
)

LLAMA = transformers.LlamaForCausalLM


@pytest.fixture
def restore_llama_forward():
    original = LLAMA.__dict__["forward"]
    yield
    LLAMA.forward = original


def _doubling(fn):
    """A wrapper a metrics / label-fixing library might install (functools.wraps)."""

    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss * 2
        return out

    return forward


# -- wrappers around the class forward --------------------------------------------------------


def test_functools_wrapper_before_patch_runs_around_the_fused_forward(spy,
                                                                      restore_llama_forward):
    LLAMA.forward = _doubling(LLAMA.forward)
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model)
    got, want = compare_with_stock(model, ref, batch(), True, spy)
    # the wrapper ran on both paths: the loss is twice the unwrapped forward's
    plain = LLAMA.forward.__wrapped__(reference_copy(ref), **batch()).loss
    assert_close_rel(got.loss, 2 * plain, LOSS_RTOL, "doubled")


def test_functools_wrapper_on_the_class_after_an_instance_patch_runs_as_stock(
        spy, restore_llama_forward):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model)
    LLAMA.forward = _doubling(LLAMA.forward)
    with pytest.warns(RuntimeWarning, match="class's forward changed"):
        compare_with_stock(model, ref, batch(), False, spy)
    # also in evaluation: the stock path is the class's forward as it is now
    model.eval(), ref.eval()
    with torch.no_grad():
        assert_close_rel(model(**batch()).loss, ref(**batch()).loss, LOSS_RTOL, "eval")
    # applying again patches the new forward: fused, wrapper included
    apply_fused_ce(model)
    model.train(), ref.train()
    model.zero_grad(), ref.zero_grad()
    spy.calls.clear()
    compare_with_stock(model, ref, batch(), True, spy)


def test_wrapper_without_wraps_is_refused(restore_llama_forward):
    inner = LLAMA.forward

    def forward(self, *args, **kwargs):  # no functools.wraps: nothing says what it wraps
        return inner(self, *args, **kwargs)

    LLAMA.forward = forward
    with pytest.raises(UnsupportedModelError):
        apply_fused_ce(build_model("llama"))


def test_wrapper_that_does_not_close_over_the_forward_is_refused(restore_llama_forward):
    class Wrapper:  # a callable object: the wrapped function is not in a closure
        def __init__(self, fn):
            self.fn = fn
            functools.update_wrapper(self, fn)

        def __get__(self, obj, cls):
            return functools.partial(self.__call__, obj)

        def __call__(self, obj, *args, **kwargs):
            return self.fn(obj, *args, **kwargs)

    LLAMA.forward = Wrapper(LLAMA.forward)
    with pytest.raises(UnsupportedModelError, match="closure"):
        apply_fused_ce(build_model("llama"))


def test_instance_wrapper_after_the_patch_wraps_the_fused_forward(spy):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model)
    model.forward = _doubling(model.forward.__func__).__get__(model)
    ref.forward = _doubling(type(ref).forward).__get__(ref)
    compare_with_stock(model, ref, batch(), True, spy)
    assert is_fused_ce_applied(model)


def test_replaced_instance_forward_reports_not_applied():
    model = build_model("llama")
    apply_fused_ce(model)
    assert is_fused_ce_applied(model)
    other = build_model("llama")
    model.forward = type(model).forward.__get__(other)  # e.g. another library's forward
    assert not is_fused_ce_applied(model)


# -- module globals -----------------------------------------------------------------------------


def test_module_global_replaced_after_the_patch_is_seen(spy, monkeypatch):
    from transformers.models.mixtral import modeling_mixtral

    from fused_ce_patch.hf import sweep

    torch.manual_seed(0)
    config = sweep.tiny_config("mixtral")
    config.router_aux_loss_coef = 0.5
    model = transformers.MixtralForCausalLM(config).train()
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    real = modeling_mixtral.load_balancing_loss_func
    monkeypatch.setattr(modeling_mixtral, "load_balancing_loss_func",
                        lambda *a, **k: 10 * real(*a, **k) + 3.0)
    b = batch()
    b["input_ids"] = b["input_ids"] % config.vocab_size
    b["labels"] = torch.where(b["labels"] >= 0, b["labels"] % config.vocab_size, -100)
    got, want = compare_with_stock(model, ref, b, True, spy)
    assert want.aux_loss is not None and got.aux_loss.item() == pytest.approx(
        want.aux_loss.item(), rel=1e-6)


# -- the loss in force --------------------------------------------------------------------------


def _smoothed(fn):
    def loss(logits, labels, vocab_size, **kwargs):
        return fn(logits, labels, vocab_size, **kwargs) + 0.1 * logits.float().mean()

    return loss


@pytest.mark.parametrize("where", ["loss_utils_and_mapping", "mapping_only", "instance"])
def test_replaced_causal_lm_loss_is_what_the_patched_model_computes(where, spy):
    import transformers.loss.loss_utils as loss_utils

    model = build_model("llama")
    ref = copy.deepcopy(model)  # no loss of its own: it reads LOSS_MAPPING like a user's model
    apply_fused_ce(model)
    saved = loss_utils.ForCausalLMLoss, dict(loss_utils.LOSS_MAPPING)
    new = _smoothed(saved[0])
    try:
        if where == "instance":
            model.loss_function = new
            ref.loss_function = new
        else:
            loss_utils.LOSS_MAPPING["ForCausalLM"] = new
            if where == "loss_utils_and_mapping":
                loss_utils.ForCausalLMLoss = new
        with pytest.warns(RuntimeWarning, match="loss function in force"):
            compare_with_stock(model, ref, batch(), False, spy)
        model.eval(), ref.eval()  # evaluation: the patch's logits loss steps aside too
        with torch.no_grad():
            assert_close_rel(model(**batch()).loss, ref(**batch()).loss, 1e-6, "eval")
    finally:
        loss_utils.ForCausalLMLoss = saved[0]
        loss_utils.LOSS_MAPPING.clear()
        loss_utils.LOSS_MAPPING.update(saved[1])
    # and back to the fused path once the stock loss is back
    model.train()
    model.zero_grad()
    spy.calls.clear()
    if where != "instance":
        ref = reference_copy(model)
        revert_fused_ce(ref)
        compare_with_stock(model, ref, batch(), True, spy)


# -- operands of the logit transform ------------------------------------------------------------


def test_trainable_logit_scale_gets_its_gradient(spy):
    from fused_ce_patch.hf import sweep

    torch.manual_seed(0)
    model = transformers.CohereForCausalLM(sweep.tiny_config("cohere")).train()
    model.logit_scale = nn.Parameter(torch.tensor(0.37))
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    b = batch()
    vocab = model.config.vocab_size
    b["input_ids"] = b["input_ids"] % vocab
    b["labels"] = torch.where(b["labels"] >= 0, b["labels"] % vocab, -100)
    compare_with_stock(model, ref, b, True, spy)
    assert ref.logit_scale.grad is not None and ref.logit_scale.grad.abs() > 0
    assert_close_rel(model.logit_scale.grad, ref.logit_scale.grad, 1e-4, "logit_scale.grad")


def test_trainable_softcap_takes_the_stock_computation(spy):
    model = build_model("gemma2")
    ref = reference_copy(model)
    # A researcher's trainable softcap (the strict config dataclass would refuse the setattr)
    for m in (model, ref):
        m.config = copy.copy(m.config)
        m.config.__dict__["final_logit_softcapping"] = nn.Parameter(torch.tensor(30.0))
    apply_fused_ce(model)
    with pytest.warns(RuntimeWarning, match="softcap requires grad"):
        compare_with_stock(model, ref, batch(), False, spy)
    assert_close_rel(model.config.final_logit_softcapping.grad,
                     ref.config.final_logit_softcapping.grad, 1e-4, "softcap grad")


# -- num_items_in_batch, as stock ---------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -3, 7, float("nan"), torch.tensor(0), torch.tensor(-2.0),
                               torch.tensor(float("nan")), torch.tensor(9), torch.tensor([5]),
                               torch.tensor([[6.0]]), torch.tensor(7.0, dtype=torch.float64),
                               torch.tensor([3], dtype=torch.float64),
                               torch.tensor(22.0, dtype=torch.float16),
                               torch.tensor([22.0], dtype=torch.float16),
                               torch.tensor([22.0], dtype=torch.bfloat16)],
                         ids=lambda n: repr(n).replace(" ", ""))
def test_num_items_in_batch_as_stock(n, spy):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model)
    kw = dict(batch(), num_items_in_batch=n)
    want = ref(**kw)
    got = model(**kw)
    assert spy.count == 1
    # stock's sum / n takes a one-element n's shape, and the promoted dtype (float64 n: float64)
    assert got.loss.shape == want.loss.shape and got.loss.dtype == want.loss.dtype
    if torch.isfinite(want.loss):  # a 16-bit quotient: rounded once by us, twice by stock
        two_ulp = 2 * torch.finfo(want.loss.dtype).eps if want.loss.element_size() < 4 else 0.0
        assert_close_rel(got.loss, want.loss, max(LOSS_RTOL, two_ulp), "loss")
    else:  # inf / NaN exactly where stock has them
        assert torch.equal(torch.isnan(got.loss), torch.isnan(want.loss))
        assert got.loss.item() == want.loss.item() or torch.isnan(want.loss)


# -- bad arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["model", 3, [1]])
def test_revert_and_query_reject_non_models(bad):
    with pytest.raises(TypeError):
        revert_fused_ce(bad)
    with pytest.raises(TypeError):
        is_fused_ce_applied(bad)


@pytest.mark.parametrize("make", [lambda: nn.Linear(2, 2),
                                  lambda: nn.Sequential(build_model("llama"))])
def test_non_causal_lm_modules_are_refused(make):
    with pytest.raises(UnsupportedModelError, match="not a transformers"):
        apply_fused_ce(make())


def test_no_warning_on_the_plain_fused_path(spy):
    model = build_model("llama")
    apply_fused_ce(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model(**batch()).loss.backward()
    assert spy.count == 1


# -- Trainer.evaluate with a batch that counts no position -------------------------------------


@pytest.mark.parametrize("how", ["flag", "apply"])
def test_evaluate_with_an_all_ignored_batch_as_stock(how, tmp_path, spy):
    """Stock gives NaN for that batch and Trainer drops it from eval_loss; a 0.0 would be
    averaged in. ``flag``: loss-only evaluation on the fused path (skip_logits); ``apply``:
    the stock forward with the patch's logits loss."""
    from transformers import Trainer, TrainingArguments

    from fused_ce_patch import FusedCETrainingArguments
    from test_trainer import make_dataset

    model = build_model("llama")
    ref = reference_copy(model)
    ds = make_dataset(counts=(5, 7, 0, 0, 6, 3))  # batch size 2: the second batch counts none

    def args(cls, name, **extra):
        return cls(output_dir=str(tmp_path / name), per_device_eval_batch_size=2, report_to=[],
                   use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0, **extra)

    want = Trainer(model=ref, args=args(TrainingArguments, "r"), eval_dataset=ds).evaluate()
    if how == "flag":
        trainer = Trainer(model=model, args=args(FusedCETrainingArguments, "f",
                                                 use_fused_ce=True), eval_dataset=ds)
    else:
        apply_fused_ce(model)
        trainer = Trainer(model=model, args=args(TrainingArguments, "f"), eval_dataset=ds)
    got = trainer.evaluate()
    assert spy.count == (3 if how == "flag" else 0)
    assert torch.isfinite(torch.tensor(want["eval_loss"]))
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=LOSS_RTOL)


# -- wrappers of other libraries around the composed model --------------------------------------


def test_peft_lora_model_with_a_class_wrapper(spy, restore_llama_forward):
    """PEFT around a model whose class forward a user wrapped: the wrapper runs around the
    fused forward, LoRA's adapters get their gradients, numbers as stock."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    LLAMA.forward = _doubling(LLAMA.forward)
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                     target_modules=["q_proj", "v_proj", "lm_head"])
    torch.manual_seed(0)
    model = get_peft_model(build_model("llama"), cfg)
    ref = reference_copy(model)
    apply_fused_ce(model)
    compare_with_stock(model, ref, batch(), True, spy)


def test_accelerate_prepared_model_with_a_class_wrapper(spy, restore_llama_forward):
    from accelerate import Accelerator

    LLAMA.forward = _doubling(LLAMA.forward)
    model = build_model("llama")
    ref = reference_copy(model)
    model = Accelerator(cpu=True).prepare(model)
    apply_fused_ce(model)
    compare_with_stock(model, ref, batch(), True, spy)


def test_deepcopy_after_a_class_change_runs_the_live_class(spy, restore_llama_forward):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model)
    LLAMA.forward = _doubling(LLAMA.forward)
    clone = copy.deepcopy(model)
    assert is_fused_ce_applied(clone)
    with pytest.warns(RuntimeWarning, match="class's forward changed"):
        compare_with_stock(clone, ref, batch(), False, spy)
    apply_fused_ce(clone)  # re-derived from the wrapped forward: fused, wrapper included
    clone.zero_grad(), ref.zero_grad()
    spy.calls.clear()
    compare_with_stock(clone, ref, batch(), True, spy)

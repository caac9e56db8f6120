"""The chunked logits loss, its per-model routing, and the Trainer's token-count check."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
import transformers.loss.loss_utils as loss_utils

from transformers import LlamaForCausalLM

from fused_ce_patch import apply_fused_ce, apply_fused_ce_to_llama, revert_fused_ce
from fused_ce_patch.hf.patch import _PATCHED_INSTANCES, is_fused_ce_applied
from fused_ce_patch.hf import loss_mapping
from fused_ce_patch.hf.loss_mapping import chunked_causal_lm_loss
from hf_helpers import VOCAB, assert_close_rel, batch, build_model, shifted

ORIGINAL = loss_utils.ForCausalLMLoss  # imported before any test patches anything


def _snapshot():
    return dict(loss_utils.LOSS_MAPPING)


def _assert_pristine(before):
    import transformers.trainer as trainer_mod

    after = _snapshot()
    assert after.keys() == before.keys()
    assert all(after[k] is v for k, v in before.items())
    assert loss_utils.ForCausalLMLoss is ORIGINAL and trainer_mod.ForCausalLMLoss is ORIGINAL


def test_patches_never_touch_loss_mapping():
    before = _snapshot()
    model = build_model("llama")
    apply_fused_ce(model)
    _assert_pristine(before)
    assert isinstance(model.loss_function, loss_mapping.InstanceLoss)
    assert "_loss_function" in model.__dict__
    revert_fused_ce(model)
    assert "_loss_function" not in model.__dict__ and model.loss_function is ORIGINAL

    apply_fused_ce_to_llama()
    _assert_pristine(before)
    assert "loss_function" in LlamaForCausalLM.__dict__
    assert build_model("llama").loss_function is chunked_causal_lm_loss
    assert build_model("qwen2").loss_function is ORIGINAL  # another class: untouched
    revert_fused_ce(LlamaForCausalLM)
    assert "loss_function" not in LlamaForCausalLM.__dict__
    _assert_pristine(before)


def _stock_behaviour(model):
    """What a never-patched model's stock loss does with two edge inputs: NaN for an
    all-ignored batch, IndexError for a label >= V (the chunked loss now matches both; the
    spy counts show which loss ran)."""
    model.eval()
    b = batch()
    with torch.no_grad():
        loss = model(input_ids=b["input_ids"], labels=torch.full_like(b["labels"], -100)).loss
        bad = b["labels"].clone()
        bad[0, 5] = VOCAB
        try:
            model(input_ids=b["input_ids"], labels=bad)
            raised = None
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            raised = type(exc)
    model.train()
    return bool(torch.isnan(loss)), raised


@pytest.mark.parametrize("how", ["instance", "class", "gc"])
def test_never_patched_model_keeps_stock_behaviour(how, logits_loss_spy):
    # Regression (issue 9, 3a): a patch used to swap LOSS_MAPPING process-wide until an explicit
    # revert, also after the patched model was garbage-collected.
    other = build_model("qwen2" if how == "class" else "llama", seed=2)
    stock = _stock_behaviour(other)
    assert stock == (True, IndexError)
    patched = build_model("llama")
    if how == "class":
        apply_fused_ce_to_llama()
    else:
        apply_fused_ce(patched)
    assert _stock_behaviour(other) == stock
    assert logits_loss_spy.count == 0
    # The patched model itself does use the chunked loss on its stock (eval) path.
    patched.eval()
    with torch.no_grad():
        patched(**batch())
    assert logits_loss_spy.count == 1
    if how == "gc":
        ref = weakref.ref(patched)
        del patched
        gc.collect()
        assert ref() is None and not _PATCHED_INSTANCES
    assert _stock_behaviour(other) == stock and logits_loss_spy.count == 1
    assert _stock_behaviour(build_model("qwen2" if how == "class" else "llama", seed=3)) == stock


def test_class_patch_keeps_an_instance_own_loss(logits_loss_spy):
    model = build_model("llama")
    custom = loss_utils.ForCausalLMLoss
    model.loss_function = custom  # the instance's explicit choice wins over the class patch
    apply_fused_ce_to_llama()
    assert model.loss_function is custom
    model.loss_function = chunked_causal_lm_loss  # the setter still works under the patch
    assert model.__dict__["_loss_function"] is chunked_causal_lm_loss


def test_deepcopy_is_tracked_and_reverted():
    # Regression (issue 9, 3b): the copy was patched but revert_fused_ce() did not reach it.
    model = build_model("llama")
    apply_fused_ce(model)
    clone = copy.deepcopy(model)
    assert is_fused_ce_applied(clone) and clone in _PATCHED_INSTANCES
    # the copy's own logits loss (it reads the copy's loss_type), reverted with it
    assert isinstance(clone.__dict__["_loss_function"], type(model.__dict__["_loss_function"]))
    assert clone.__dict__["_loss_function"] is not model.__dict__["_loss_function"]
    revert_fused_ce()
    for m in (model, clone):
        assert not is_fused_ce_applied(m)
        assert "forward" not in m.__dict__ and "_loss_function" not in m.__dict__
    assert isinstance(clone(**batch()).logits, torch.Tensor)


def test_pickle_restores_the_stock_loss():
    model = build_model("llama")
    apply_fused_ce(model)
    clone = pickle.loads(pickle.dumps(model))
    assert not is_fused_ce_applied(clone) and clone.loss_function is ORIGINAL
    assert _stock_behaviour(clone) == (True, IndexError)


def _trainer(model, tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             per_device_train_batch_size=2)
    return Trainer(model=model, args=args)


@pytest.mark.parametrize("how", ["instance", "class"])
def test_trainer_counts_shifted_labels_when_patched_before_init(how, tmp_path):
    model = build_model("llama")
    if how == "class":
        apply_fused_ce_to_llama()
    else:
        apply_fused_ce(model)  # patched before Trainer.__init__: the identity pitfall case
    trainer = _trainer(model, tmp_path)
    assert trainer._loss_shifts_labels is True
    b = batch()
    expected = int((b["labels"][..., 1:] != -100).sum())
    assert int(trainer._get_num_items_in_batch([b], torch.device("cpu"))) == expected


def _cases():
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, VOCAB, (3, 9), generator=g)
    labels[0, :4] = -100
    labels[2, 6:] = -100
    return labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("variant", ["labels", "shift_labels", "num_items_int",
                                     "num_items_tensor", "ignore_index"])
def test_replacement_equals_for_causal_lm_loss(dtype, variant, monkeypatch):
    monkeypatch.setattr(loss_mapping, "CHUNK_BYTES", 4 * VOCAB * 5)  # 5 rows a chunk: uneven
    labels = _cases()
    torch.manual_seed(0)
    logits = (torch.randn(3, 9, VOCAB) * 4).to(dtype).requires_grad_()
    kwargs = {}
    if variant == "shift_labels":
        kwargs["shift_labels"] = shifted(labels)
    if variant == "num_items_int":
        kwargs["num_items_in_batch"] = 11
    if variant == "num_items_tensor":
        kwargs["num_items_in_batch"] = torch.tensor(11)
    if variant == "ignore_index":
        labels = torch.where(labels == -100, -1, labels)
        kwargs["ignore_index"] = -1
    want = ORIGINAL(logits, labels, VOCAB, **kwargs)
    upstream = torch.tensor(1.7)
    (want_grad,) = torch.autograd.grad(want * upstream, logits)
    got = chunked_causal_lm_loss(logits, labels, VOCAB, **kwargs)
    (got_grad,) = torch.autograd.grad(got * upstream, logits)

    assert got.dtype == want.dtype
    tol = 1e-6  # both compute in float32 whatever the logits dtype
    assert_close_rel(got, want, tol, "loss")
    assert got_grad.dtype == dtype
    gtol = {torch.float64: 1e-6, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert_close_rel(got_grad, want_grad, gtol, "grad")


def test_replacement_edge_cases():
    logits = torch.randn(2, 4, VOCAB, requires_grad=True)
    none = torch.full((2, 4), -100)
    loss = chunked_causal_lm_loss(logits, none, VOCAB)
    assert loss.isnan()  # as ForCausalLMLoss (tests/hf/test_logits_loss_stock.py)
    loss.backward()
    assert not logits.grad.any()
    bad = torch.zeros(2, 4, dtype=torch.long)
    bad[1, 2] = VOCAB
    with pytest.raises(IndexError, match=f"label {VOCAB}"):
        chunked_causal_lm_loss(logits, bad, VOCAB)


def test_backward_leaves_float32_logits_untouched_and_can_run_twice():
    # Regression: the backward once computed the softmax in place over a view of the logits.
    torch.manual_seed(0)
    logits = torch.randn(3, 7, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (3, 7))
    before = logits.detach().clone()
    loss = chunked_causal_lm_loss(logits, labels, VOCAB)
    (g1,) = torch.autograd.grad(loss, logits, retain_graph=True)
    assert torch.equal(logits.detach(), before)
    (g2,) = torch.autograd.grad(loss, logits)
    ref = ORIGINAL(logits, labels, VOCAB)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert_close_rel(g1, g_ref, 1e-5, "grad")
    assert torch.equal(g1, g2)


def test_double_backward_is_refused_not_silently_detached():
    logits = torch.randn(2, 5, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 5))
    loss = chunked_causal_lm_loss(logits, labels, VOCAB)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, logits, create_graph=True)


def test_logits_and_labels_of_different_sizes_raise():
    logits = torch.randn(2, 6, VOCAB)
    with pytest.raises(ValueError, match="batch_size"):
        chunked_causal_lm_loss(logits, torch.randint(0, VOCAB, (2, 9)), VOCAB)
    with pytest.raises(ValueError, match="batch_size"):
        chunked_causal_lm_loss(logits, torch.randint(0, VOCAB, (2, 4)), VOCAB)


@pytest.mark.parametrize("n", [3, torch.tensor(0.5), torch.tensor(7.25), torch.tensor(11)])
def test_num_items_in_batch_divides_exactly(n):
    logits = torch.randn(2, 6, VOCAB)
    labels = torch.randint(0, VOCAB, (2, 6))
    got = chunked_causal_lm_loss(logits, labels, VOCAB, num_items_in_batch=n)
    ref = ORIGINAL(logits, labels, VOCAB, num_items_in_batch=n)
    assert_close_rel(got, ref, 1e-5, f"num_items={n!r}")


def test_peft_wrapped_patch_is_routed_on_the_base_model_only(logits_loss_spy):
    peft = pytest.importorskip("peft")
    base = build_model("llama")
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    other = build_model("llama", seed=2)
    apply_fused_ce(wrapped)
    assert isinstance(base.__dict__["_loss_function"], loss_mapping.InstanceLoss)
    assert _stock_behaviour(other) == (True, IndexError) and logits_loss_spy.count == 0
    revert_fused_ce(wrapped)
    assert "_loss_function" not in base.__dict__ and base.loss_function is ORIGINAL


def test_class_patched_eval_loss_equals_stock(logits_loss_spy):
    model = build_model("llama").eval()
    b = batch()
    with torch.no_grad():
        want = model(**b).loss
    apply_fused_ce_to_llama()
    with torch.no_grad():
        got = model(**b).loss
    assert logits_loss_spy.count == 1
    assert_close_rel(got, want, 1e-6, "eval loss")

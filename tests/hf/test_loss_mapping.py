"""The LOSS_MAPPING replacement and the Trainer's token-count identity check."""

from __future__ import annotations

import pytest
import torch
import transformers.loss.loss_utils as loss_utils

from fused_ce_patch import apply_fused_ce, apply_fused_ce_to_llama, revert_fused_ce
from fused_ce_patch.hf import loss_mapping
from fused_ce_patch.hf.loss_mapping import chunked_causal_lm_loss
from hf_helpers import VOCAB, assert_close_rel, batch, build_model, shifted

ORIGINAL = loss_utils.ForCausalLMLoss  # imported before any test patches anything


def _snapshot():
    return dict(loss_utils.LOSS_MAPPING)


def test_identity_before_after_revert(tmp_path):
    import transformers.trainer as trainer_mod

    before = _snapshot()
    aliased = [k for k, v in before.items() if v is ORIGINAL]
    assert "ForCausalLM" in aliased and "ForConditionalGeneration" in aliased
    assert trainer_mod.ForCausalLMLoss is ORIGINAL

    model = build_model("llama")
    apply_fused_ce(model)
    after = _snapshot()
    for key, value in before.items():
        if key in aliased:
            assert after[key] is chunked_causal_lm_loss, key
        else:
            assert after[key] is value, key
    assert loss_utils.ForCausalLMLoss is chunked_causal_lm_loss
    assert trainer_mod.ForCausalLMLoss is chunked_causal_lm_loss
    assert model.loss_function is chunked_causal_lm_loss

    # A second patch keeps the registration; only the last revert restores.
    other = build_model("llama", seed=1)
    apply_fused_ce(other)
    revert_fused_ce(model)
    assert loss_utils.LOSS_MAPPING["ForCausalLM"] is chunked_causal_lm_loss
    revert_fused_ce(other)
    restored = _snapshot()
    assert restored.keys() == before.keys()
    assert all(restored[k] is before[k] for k in before)
    assert loss_utils.ForCausalLMLoss is ORIGINAL and trainer_mod.ForCausalLMLoss is ORIGINAL

    apply_fused_ce_to_llama()
    assert loss_utils.LOSS_MAPPING["ForCausalLM"] is chunked_causal_lm_loss
    revert_fused_ce()
    assert all(loss_utils.LOSS_MAPPING[k] is before[k] for k in before)


def _trainer(model, tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             per_device_train_batch_size=2)
    return Trainer(model=model, args=args)


def test_trainer_counts_shifted_labels_when_patched_before_init(tmp_path):
    import transformers.trainer as trainer_mod

    model = build_model("llama")
    apply_fused_ce(model)  # registered before Trainer.__init__: the pitfall case
    trainer = _trainer(model, tmp_path)
    assert trainer._loss_shifts_labels is True
    b = batch()
    expected = int((b["labels"][..., 1:] != -100).sum())
    assert int(trainer._get_num_items_in_batch([b], torch.device("cpu"))) == expected

    # Why the module-level name matters: with only LOSS_MAPPING swapped, Trainer would count
    # the unshifted labels (one token too many per row).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer_mod, "ForCausalLMLoss", ORIGINAL)
        assert _trainer(model, tmp_path)._loss_shifts_labels is False


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
    assert loss.item() == 0.0  # ForCausalLMLoss gives NaN here; documented deviation
    loss.backward()
    assert not logits.grad.any()
    bad = torch.zeros(2, 4, dtype=torch.long)
    bad[1, 2] = VOCAB
    with pytest.raises(ValueError, match=f"label {VOCAB}"):
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

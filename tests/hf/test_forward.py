"""The shared patched forward against the stock forward, for every supported architecture."""

from __future__ import annotations

import inspect

import pytest
import torch

from fused_ce_patch import apply_fused_ce
from fused_ce_patch.hf.sentinel import NotMaterializedLogits

from hf_helpers import (
    ARCHS,
    GEMMA2_SOFTCAP,
    LOSS_RTOL,
    VOCAB,
    assert_close_rel,
    assert_grads_close,
    batch,
    build_model,
    reference_copy,
    shifted,
)

try:
    from transformers.modeling_utils import slice_logits_to_keep  # noqa: F401

    HAS_SLICE_HELPER = True
except ImportError:  # transformers < 5.21
    HAS_SLICE_HELPER = False


def patched_pair(arch, **overrides):
    model = build_model(arch, **overrides)
    ref = reference_copy(model)
    apply_fused_ce(model)
    return model, ref


def check_softcap_precondition(arch, ref, inputs):
    if arch != "gemma2":
        return
    with torch.no_grad():
        hidden = ref.model(input_ids=inputs["input_ids"]).last_hidden_state
        raw = ref.lm_head(hidden)
    assert raw.abs().max() > 2 * GEMMA2_SOFTCAP, "Gemma2 raw logits must exceed +-60"


def _scenario(name):
    b = batch(pad_row=name != "labels")
    ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
    if name == "labels":
        return {"input_ids": ids, "labels": ids}, {"input_ids": ids, "labels": ids}
    if name == "padded":
        return dict(b), dict(b)
    if name == "labels_and_shift_labels":
        # shift_labels wins over labels (ForCausalLMLoss); unrelated labels prove it.
        other = torch.randint(0, VOCAB, labels.shape, generator=torch.Generator().manual_seed(7))
        kw = {"input_ids": ids, "attention_mask": mask, "labels": other,
              "shift_labels": shifted(labels)}
        return kw, dict(kw)
    if name == "logits_to_keep_int":
        kw = {"input_ids": ids, "attention_mask": mask, "labels": labels[:, -6:],
              "logits_to_keep": 6}
        return kw, dict(kw)
    if name == "logits_to_keep_positions":
        keep = torch.tensor([1, 4, 7, 10, 12])
        kw = {"input_ids": ids, "attention_mask": mask, "labels": labels[:, keep],
              "logits_to_keep": keep}
        return kw, dict(kw)
    if name == "num_items_in_batch":
        kw = dict(b, num_items_in_batch=torch.tensor(37))
        return kw, dict(kw)
    if name == "eval":
        return dict(b), dict(b)
    raise ValueError(name)


SCENARIOS = ("labels", "padded", "labels_and_shift_labels",
             "logits_to_keep_int", "logits_to_keep_positions", "num_items_in_batch", "eval")


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("arch", ARCHS)
def test_patched_equals_stock(arch, scenario, spy, logits_loss_spy):
    model, ref = patched_pair(arch)
    kw, ref_kw = _scenario(scenario)
    check_softcap_precondition(arch, ref, kw)
    if scenario == "eval":
        model.eval()
        ref.eval()

    out_ref = ref(**ref_kw)
    assert spy.count == 0 and logits_loss_spy.count == 0, "reference touched fused_ce_patch"
    out = model(**kw)

    if scenario == "eval":
        # Evaluation is the stock forward; its loss is the instance's chunked logits loss.
        assert spy.count == 0 and logits_loss_spy.count == 1
        assert isinstance(out.logits, torch.Tensor)
        assert_close_rel(out.logits, out_ref.logits, LOSS_RTOL, "logits")
    else:
        assert spy.count == 1 and logits_loss_spy.count == 0
        call = spy.calls[0]
        assert call["softcap"] == (GEMMA2_SOFTCAP if arch == "gemma2" else None)
        assert call["shift"] is ("shift_labels" not in kw)
        assert call["weight"] is model.get_output_embeddings().weight
        assert isinstance(out.logits, NotMaterializedLogits)
    assert torch.isfinite(out.loss)
    assert_close_rel(out.loss, out_ref.loss, LOSS_RTOL, "loss")

    out.loss.backward()
    out_ref.loss.backward()
    assert_grads_close(model, ref)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_shift_labels_without_labels_gives_no_loss_as_stock(mode, spy):
    """The stock forward computes a loss only when ``labels`` is given: ``shift_labels``
    alone gives ``loss=None`` in every mode, and so does the patched model."""
    model, ref = patched_pair("llama")
    b = batch()
    kw = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
          "shift_labels": shifted(b["labels"])}
    for m in (model, ref):
        m.train(mode == "train")
    want, got = ref(**kw), model(**kw)
    assert want.loss is None and got.loss is None
    assert spy.count == 0
    assert isinstance(got.logits, torch.Tensor)


@pytest.mark.skipif(not HAS_SLICE_HELPER, reason="boolean logits_to_keep needs transformers>=5.21")
def test_logits_to_keep_boolean_mask(spy):
    model, ref = patched_pair("llama")
    b = batch()
    keep = b["attention_mask"].bool()
    labels = b["labels"][keep]  # flat, like the kept hidden states
    out_ref = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=labels,
                  logits_to_keep=keep)
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=labels,
                logits_to_keep=keep)
    assert spy.count == 1
    assert_close_rel(out.loss, out_ref.loss, LOSS_RTOL, "loss")
    out.loss.backward()
    out_ref.loss.backward()
    assert_grads_close(model, ref)


def test_gemma3_with_softcap(spy):
    model, ref = patched_pair("gemma3_text", final_logit_softcapping=5.0)
    b = batch()
    out_ref, out = ref(**b), model(**b)
    assert spy.count == 1 and spy.calls[0]["softcap"] == 5.0
    assert_close_rel(out.loss, out_ref.loss, LOSS_RTOL, "loss")
    out.loss.backward()
    out_ref.loss.backward()
    assert_grads_close(model, ref)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_all_ignored_labels_give_stock_nan_and_zero_grads(arch, spy):
    """Stock's mean over no counted position is NaN with zero gradients (Trainer.evaluate drops
    such a batch); with num_items_in_batch it is 0 / n."""
    model = build_model(arch)
    ref = reference_copy(model)
    apply_fused_ce(model)
    b = batch()
    kw = {"input_ids": b["input_ids"], "labels": torch.full_like(b["labels"], -100)}
    out, want = model(**kw), ref(**kw)
    assert spy.count == 1
    assert torch.isnan(want.loss) and torch.isnan(out.loss)
    out.loss.backward()
    want.loss.backward()
    for m in (model, ref):
        for name, p in m.named_parameters():
            assert p.grad is None or not p.grad.any(), name
    out = model(**kw, num_items_in_batch=torch.tensor(5))
    want = ref(**kw, num_items_in_batch=torch.tensor(5))
    assert spy.count == 2 and out.loss.item() == 0.0 == want.loss.item()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_return_dict_false_keeps_stock_tuple_layout(arch, spy):
    model, ref = patched_pair(arch)
    b = batch()
    kw = dict(b, return_dict=False, output_hidden_states=True, use_cache=True)
    got, want = model(**kw), ref(**kw)
    assert spy.count == 1
    assert isinstance(got, tuple) and len(got) == len(want)
    assert_close_rel(got[0], want[0], LOSS_RTOL, "loss")
    assert isinstance(got[1], NotMaterializedLogits) and isinstance(want[1], torch.Tensor)
    assert type(got[2]) is type(want[2])  # the cache
    for h_got, h_want in zip(got[3], want[3]):
        assert_close_rel(h_got, h_want, LOSS_RTOL, "hidden states")


def test_decoder_outputs_pass_through(spy):
    model, ref = patched_pair("mistral")
    b = batch()
    got = model(**b, output_hidden_states=True, output_attentions=True, use_cache=True)
    want = ref(**b, output_hidden_states=True, output_attentions=True, use_cache=True)
    assert spy.count == 1
    assert len(got.hidden_states) == len(want.hidden_states)
    assert len(got.attentions) == len(want.attentions)
    for a, w in zip(got.attentions, want.attentions):
        assert_close_rel(a, w, LOSS_RTOL, "attentions")
    assert got.to_tuple()[2].__class__ is want.to_tuple()[2].__class__


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_identical(arch, spy):
    model, ref = patched_pair(arch)
    prompt = batch(batch_size=1, seq=5, pad_row=False)["input_ids"]
    for mode in ("eval", "train"):
        getattr(model, mode)()
        getattr(ref, mode)()
        got = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        want = ref.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want), mode
    assert spy.count == 0


def test_no_grad_training_mode_is_stock(spy):
    model, ref = patched_pair("llama")
    b = batch()
    with torch.no_grad():
        got, want = model(**b), ref(**b)
    assert spy.count == 0
    assert isinstance(got.logits, torch.Tensor)
    assert_close_rel(got.logits, want.logits, LOSS_RTOL, "logits")
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss")


def test_no_labels_is_stock(spy):
    model, ref = patched_pair("qwen2")
    b = batch()
    got = model(input_ids=b["input_ids"])
    want = ref(input_ids=b["input_ids"])
    assert spy.count == 0 and got.loss is None
    assert_close_rel(got.logits, want.logits, LOSS_RTOL, "logits")


def test_skip_logits_overrides_mode(spy):
    model, _ = patched_pair("llama")
    b = batch()
    model.eval()
    with torch.no_grad():
        out = model(**b, skip_logits=True)
    assert spy.count == 1 and isinstance(out.logits, NotMaterializedLogits)
    model.train()
    out = model(**b, skip_logits=False)
    assert spy.count == 1 and isinstance(out.logits, torch.Tensor)
    with pytest.raises(ValueError, match="skip_logits"):
        model(input_ids=b["input_ids"], skip_logits=True)


def test_return_logits_option_and_env(spy, monkeypatch):
    model, ref = patched_pair("gemma2")
    b = batch()
    want = ref(**b)
    apply_fused_ce(model, return_logits=True)
    got = model(**b)
    assert spy.count == 0
    assert_close_rel(got.logits, want.logits, LOSS_RTOL, "logits")
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss")

    apply_fused_ce(model, return_logits=False)
    monkeypatch.setenv("FUSED_CE_RETURN_LOGITS", "1")
    assert isinstance(model(**b).logits, torch.Tensor) and spy.count == 0
    monkeypatch.setenv("FUSED_CE_RETURN_LOGITS", "0")
    assert isinstance(model(**b).logits, NotMaterializedLogits) and spy.count == 1


def test_custom_loss_function_keeps_stock_path(spy):
    model, _ = patched_pair("llama")
    seen = []

    def my_loss(logits, labels, vocab_size, **kwargs):
        seen.append(logits)
        return logits.float().mean()

    model.loss_function = my_loss
    out = model(**batch())
    assert spy.count == 0 and len(seen) == 1 and isinstance(out.logits, torch.Tensor)


def test_signature_is_the_stock_one():
    model, ref = patched_pair("gemma3_text")
    sig = inspect.signature(model.forward)
    assert sig == inspect.signature(ref.forward)
    assert "logits_to_keep" in sig.parameters and "labels" in sig.parameters
    assert any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    assert model.forward.__name__ == "forward"


def test_positional_arguments(spy):
    model, ref = patched_pair("llama")
    b = batch()
    # forward(input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, ...)
    got = model(b["input_ids"], b["attention_mask"], None, None, None, b["labels"])
    want = ref(b["input_ids"], b["attention_mask"], None, None, None, b["labels"])
    assert spy.count == 1
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss")


def test_inputs_embeds(spy):
    model, ref = patched_pair("qwen2")
    b = batch()
    emb = ref.get_input_embeddings()(b["input_ids"]).detach()
    got = model(inputs_embeds=emb, attention_mask=b["attention_mask"], labels=b["labels"])
    want = ref(inputs_embeds=emb, attention_mask=b["attention_mask"], labels=b["labels"])
    assert spy.count == 1
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss")


def test_gradient_checkpointing(spy):
    model, ref = patched_pair("llama")
    for m in (model, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    b = batch()
    got, want = model(**b), ref(**b)
    assert spy.count == 1
    got.loss.backward()
    want.loss.backward()
    assert_grads_close(model, ref)


def test_cache_argument_passes_through(spy):
    from transformers import DynamicCache

    model, ref = patched_pair("llama")
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    b = batch()
    cache, ref_cache = DynamicCache(config=model.config), DynamicCache(config=ref.config)
    got = model(**b, use_cache=True, **{name: cache})
    want = ref(**b, use_cache=True, **{name: ref_cache})
    assert spy.count == 1
    assert got.to_tuple()[2] is cache and cache.get_seq_length() == ref_cache.get_seq_length() == 16
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss")
    if name == "cache":  # transformers >= 5.2x still accepts the old name (deprecate_kwarg)
        old = DynamicCache(config=model.config)
        got = model(**b, use_cache=True, past_key_values=old)
        assert spy.count == 2 and old.get_seq_length() == 16

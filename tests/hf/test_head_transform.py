"""A head with a transform before the vocabulary projection (issue 37 item 3, hf/head_path.py).

RoBERTa (``lm_head``: dense -> gelu -> layer_norm -> decoder), BERT (``cls`` -> ``predictions``
-> transform -> decoder), BERT-generation (``lm_head`` -> decoder) and the ModernBERT decoder
(``self.decoder(self.lm_head(h))``) were refused; now the fused loss takes the input of
``get_output_embeddings()``, computed by the head's own code.

Tolerances, from the arithmetic. The models run in float64. Against the unpatched model: loss
1e-6 and gradients 1e-5 relative (the proof's float64 tolerances): transformers'
``ForCausalLMLoss`` computes the stock loss from ``logits.float()``, so the stock side carries
float32 rounding (unit roundoff 2**-24 ~ 6e-8 per logit, on both the loss and the logits'
gradient) while the fused side is float64 throughout. Against a plain float64 reference (the
stock model's logits, ``F.cross_entropy`` in float64): loss 2**-23 (the fused float64 loss is
returned as float32, as stock's, one rounding) and gradients 1e-10 (float64 sums over a
97-token vocabulary and 30 positions, ~1e-14 each, with ample margin).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from fused_ce_patch import (
    UnsupportedModelError,
    apply_fused_ce,
    apply_fused_ce_to_class,
    is_fused_ce_applied,
    revert_fused_ce,
)
from fused_ce_patch.hf import head_path as head_path_module
from fused_ce_patch.hf import proof
from fused_ce_patch.hf.architectures import derive_spec
from fused_ce_patch.hf.sentinel import NotMaterializedLogits
from hf_helpers import reference_copy

pytestmark = pytest.mark.usefixtures("fresh_proofs")  # tests/hf/conftest.py

VOCAB = 97  # prime: no chunk divides it
LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5  # against stock (its loss rounds the logits to float32)
REF_LOSS_RTOL, REF_GRAD_RTOL = 2.0 ** -23, 1e-10  # against the float64 reference
TYPES = ("roberta", "bert", "bert-generation", "modernbert-decoder", "rembert", "xmod")

#: The head-transform parameters each type must give a gradient to (beyond the decoder).
TRANSFORM_PARAMS = {
    "roberta": ("lm_head.dense.weight", "lm_head.dense.bias", "lm_head.layer_norm.weight",
                "lm_head.layer_norm.bias", "lm_head.bias"),
    "bert": ("cls.predictions.transform.dense.weight", "cls.predictions.transform.LayerNorm.weight",
             "cls.predictions.transform.LayerNorm.bias", "cls.predictions.bias"),
    "bert-generation": ("lm_head.bias",),
    "modernbert-decoder": ("lm_head.dense.weight", "lm_head.norm.weight", "decoder.bias"),
    "xmod": ("lm_head.dense.weight", "lm_head.layer_norm.weight", "lm_head.bias"),
    "rembert": ("cls.predictions.dense.weight", "cls.predictions.LayerNorm.weight",
                "cls.predictions.decoder.bias"),
}


def _config(model_type: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64, is_decoder=True,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type == "modernbert-decoder":
        common.update(sliding_window=8, local_attention=16, cls_token_id=1, sep_token_id=2,
                      layer_types=["full_attention", "sliding_attention"])
    if model_type == "xmod":  # its adapters need a language (stock raises without one)
        common.update(languages=["en_XX", "de_DE"], default_language="de_DE")
    if model_type == "rembert":
        common.update(input_embedding_size=16, output_embedding_size=24)
    config = transformers.AutoConfig.for_model(model_type, **common)
    config._attn_implementation = "eager"
    return config


def _build(model_type: str, seed: int = 0):
    torch.manual_seed(seed)
    config = _config(model_type)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64).train()
    with torch.no_grad():  # non-zero biases, so that the decoder bias's gradient is tested
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 16), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    mask[1, 11:] = 0
    labels[1, 11:] = -100  # right padding
    labels[0, :3] = -100  # a masked prompt
    labels[0, 7] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _run(model, batch, seed: int = 5):
    """Loss, outputs and every parameter gradient of one training step (dropout seeded)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}


def _assert_same(got, want, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL, must=()):
    (out, grads), (ref_out, ref_grads) = got, want
    err = ((out.loss.double() - ref_out.loss.double()).abs() / ref_out.loss.double().abs()).item()
    assert err <= loss_rtol, f"loss {out.loss.item()} vs {ref_out.loss.item()} ({err:.2e})"
    assert grads.keys() == ref_grads.keys()
    for name in must:
        assert name in ref_grads and ref_grads[name].abs().max() > 0, name
    floor = _floor(ref_grads)
    for name, w in ref_grads.items():
        gerr = ((grads[name] - w).norm() / max(w.norm().item(), floor)).item()
        assert gerr <= grad_rtol, f"gradient of {name}: relative error {gerr:.2e}"


def _floor(grads) -> float:
    """1e-3 of the largest gradient norm, as the proof's: a gradient that is zero in exact
    arithmetic (an attention key bias: softmax ignores a constant shift) is rounding noise."""
    return 1e-3 * max(g.norm().item() for g in grads.values())


def _float64_reference(model, batch, seed: int = 5):
    """The plain reference: the unpatched model's logits (no labels), the shifted
    cross-entropy in float64 (mean over counted positions), its gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    kw = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**kw).logits
    assert logits.dtype == torch.float64
    target = batch["labels"][:, 1:].reshape(-1)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), target, ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("model_type", TYPES)
def test_patched_matches_stock_loss_and_every_gradient(model_type, spy):
    model = _build(model_type)
    ref = reference_copy(model)
    plain = copy.deepcopy(model)
    batch = _batch()
    want = _run(ref, batch)
    apply_fused_ce(model, backend="torch")
    assert is_fused_ce_applied(model)
    got = _run(model, batch)
    assert spy.count == 1, "the fused loss did not run"
    assert isinstance(got[0].logits, NotMaterializedLogits)
    # the fused loss was given the projection and its input, not the head module's output
    projection = model.get_output_embeddings()
    assert spy.calls[0]["weight"].shape == projection.weight.shape
    assert spy.calls[0]["hidden"].shape[-1] == projection.in_features
    _assert_same(got, want, must=TRANSFORM_PARAMS[model_type])
    # and against the float64 reference: far tighter than stock's own float32 rounding
    ref_loss, ref_grads = _float64_reference(plain, batch)
    assert abs(got[0].loss.item() - ref_loss.item()) <= REF_LOSS_RTOL * abs(ref_loss.item())
    floor = _floor(ref_grads)
    for name, w in ref_grads.items():
        gerr = ((got[1][name] - w).norm() / max(w.norm().item(), floor)).item()
        assert gerr <= REF_GRAD_RTOL, f"gradient of {name}: {gerr:.2e} against float64"


@pytest.mark.parametrize("model_type", ("roberta", "bert"))
def test_num_items_in_batch_and_shift_labels(model_type, spy):
    model = _build(model_type)
    ref = reference_copy(model)
    batch = _batch(seed=2)
    labels = batch.pop("labels")
    shift = torch.cat([labels[:, 1:], labels.new_full((2, 1), -100)], dim=1)
    for kw in ({"labels": labels, "num_items_in_batch": torch.tensor(40)},
               {"labels": labels, "shift_labels": shift}):
        want = _run(ref, {**batch, **kw})
        apply_fused_ce(model, backend="torch")
        got = _run(model, {**batch, **kw})
        assert isinstance(got[0].logits, NotMaterializedLogits)
        _assert_same(got, want)
        revert_fused_ce(model)
    assert spy.count == 2


@pytest.mark.parametrize("model_type", ("roberta", "bert", "modernbert-decoder"))
def test_eval_and_no_labels_give_stock_logits(model_type, spy):
    model = _build(model_type)
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    batch = _batch()
    kw = {k: v for k, v in batch.items() if k != "labels"}
    torch.manual_seed(3)
    got = model(**kw).logits
    torch.manual_seed(3)
    want = ref(**kw).logits
    assert torch.equal(got, want)  # the stock forward itself
    model.eval()
    ref.eval()
    with torch.no_grad():
        out, ref_out = model(**batch), ref(**batch)
    assert torch.equal(out.logits, ref_out.logits)
    assert abs(out.loss.item() - ref_out.loss.item()) <= LOSS_RTOL * abs(ref_out.loss.item())
    assert spy.count == 0


def _scaled_roberta_head_forward(self, features, **kwargs):
    x = gelu_(self.dense(features))
    x = self.layer_norm(x) * 2.0
    return self.decoder(x)


def _closure_forward():
    scale = 2.0

    def forward(self, features, **kwargs):
        return self.decoder(self.dense(features) * scale)

    return forward


def _halve(module, args, output):
    return output * 0.5


@pytest.mark.parametrize("model_type,where", [("roberta", "lm_head"), ("bert", "cls"),
                                               ("bert", "cls.predictions"),
                                               ("bert-generation", "lm_head")])
def test_forward_hook_on_the_head_module_takes_the_stock_path(model_type, where, spy):
    """A hook on a module between the head call and the projection changes the logits; the
    fused loss would bypass it, so the call runs the stock head (one warning), stock numbers."""
    model = _build(model_type)
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, ref):
        m.get_submodule(where).register_forward_hook(_halve)
    batch = _batch()
    want = _run(ref, batch)
    with pytest.warns(RuntimeWarning, match="forward hooks"):
        got = _run(model, batch)
    assert spy.count == 0
    assert torch.is_tensor(got[0].logits) and not isinstance(got[0].logits, NotMaterializedLogits)
    torch.testing.assert_close(got[0].logits, want[0].logits, rtol=0, atol=0)
    _assert_same(got, want)


def test_hook_inside_the_transform_keeps_the_fused_path(spy):
    """A hook on the transform's own dense layer runs in the fused path too (the head's code is
    run, not read): fused, with the hook's effect on loss and gradients."""
    model = _build("roberta")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, ref):
        m.lm_head.dense.register_forward_hook(_halve)
    batch = _batch()
    want = _run(ref, batch)
    got = _run(model, batch)
    assert spy.count == 1 and isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, want, must=TRANSFORM_PARAMS["roberta"])


def test_hook_on_the_projection_materialises_from_the_transformed_input(spy):
    """A hook on the decoder itself (added after the patch): the call computes the logits as
    stock does, the projection called on the transform's output."""
    model = _build("bert")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, ref):
        m.get_output_embeddings().register_forward_hook(_halve)
    batch = _batch()
    want = _run(ref, batch)
    with pytest.warns(RuntimeWarning, match="forward hooks"):
        got = _run(model, batch)
    assert spy.count == 0
    torch.testing.assert_close(got[0].logits, want[0].logits, rtol=0, atol=0)
    _assert_same(got, want)


def test_head_class_forward_replaced_after_the_patch_takes_the_stock_path(monkeypatch, spy):
    """An instance patch analysed RobertaLMHead.forward; a different one in force at the call
    (here one that scales the transformed states) runs as stock, with its numbers."""
    from transformers.models.roberta.modeling_roberta import RobertaLMHead

    model = _build("roberta")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    monkeypatch.setattr(RobertaLMHead, "forward", _scaled_roberta_head_forward)
    batch = _batch()
    want = _run(ref, batch)
    with pytest.warns(RuntimeWarning, match="not the one analysed"):
        got = _run(model, batch)
    assert spy.count == 0
    _assert_same(got, want)
    # patched again, the new forward is analysed (and proven) and the fused path runs
    apply_fused_ce(model, backend="torch")
    got = _run(model, batch)
    assert spy.count == 1 and isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, want)


def test_forward_hook_present_at_apply_is_refused():
    model = _build("roberta")
    model.lm_head.register_forward_hook(_halve)
    with pytest.raises(UnsupportedModelError, match=r"self\.lm_head.*lm_head \(.*forward hooks"):
        apply_fused_ce(model, backend="torch")
    assert not is_fused_ce_applied(model)


class _AddsAfterTheProjection(transformers.models.roberta.modeling_roberta.RobertaLMHead):
    def forward(self, features, **kwargs):
        x = self.layer_norm(gelu_(self.dense(features)))
        return self.decoder(x) + 1.0


class _ReturnsEarly(transformers.models.roberta.modeling_roberta.RobertaLMHead):
    def forward(self, features, **kwargs):
        x = self.dense(features)
        if kwargs.get("raw"):
            return x
        x = self.decoder(x)
        return x


class _TwoLevelsReturnsOther(transformers.models.bert.modeling_bert.BertOnlyMLMHead):
    def forward(self, sequence_output):
        scores = self.predictions(sequence_output)  # noqa: F841 - the shape under test
        return sequence_output


def gelu_(x):
    return F.gelu(x)


@pytest.mark.parametrize("model_type,attr,cls,match", [
    ("roberta", "lm_head", _AddsAfterTheProjection,
     r"_AddsAfterTheProjection\.forward: does not return the call of one submodule: "
     r"`return self\.decoder\(x\) \+ 1\.0`"),
    ("roberta", "lm_head", _ReturnsEarly, r"_ReturnsEarly\.forward returns early"),
    ("bert", "cls", _TwoLevelsReturnsOther,
     r"_TwoLevelsReturnsOther\.forward: does not return the call of one submodule: "
     r"`return sequence_output`"),
])
def test_head_forward_that_does_not_fit_is_refused(model_type, attr, cls, match):
    model = _build(model_type)
    getattr(model, attr).__class__ = cls
    with pytest.raises(UnsupportedModelError, match=match) as info:
        apply_fused_ce(model, backend="torch")
    assert f"calls self.{attr}" in str(info.value)
    assert not is_fused_ce_applied(model)


def test_head_that_does_not_contain_the_projection_is_refused(monkeypatch):
    model = _build("roberta")
    other = nn.Linear(32, VOCAB).to(torch.float64)
    monkeypatch.setattr(model, "get_output_embeddings", lambda: other)
    with pytest.raises(UnsupportedModelError, match="neither is nor contains"):
        apply_fused_ce(model, backend="torch")


def test_revert_restores_stock(spy):
    model = _build("bert")
    ref = reference_copy(model)
    before = dict(model.__dict__)
    apply_fused_ce(model, backend="torch")
    revert_fused_ce(model)
    assert not is_fused_ce_applied(model)
    assert model.__dict__.keys() == before.keys()
    assert all(model.__dict__[k] is v for k, v in before.items())
    batch = _batch()
    got, want = _run(model, batch), _run(ref, batch)
    assert spy.count == 0 and torch.equal(got[0].logits, want[0].logits)
    _assert_same(got, want)


def test_class_patch_and_its_revert(spy):
    model = _build("roberta")
    ref = reference_copy(model)
    batch = _batch()
    want = _run(ref, batch)
    cls = type(model)
    apply_fused_ce_to_class(cls, backend="torch")
    try:
        got = _run(model, batch)
        assert spy.count == 1 and isinstance(got[0].logits, NotMaterializedLogits)
        _assert_same(got, want, must=TRANSFORM_PARAMS["roberta"])
    finally:
        revert_fused_ce(cls)
    got = _run(model, batch)
    assert spy.count == 1 and not isinstance(got[0].logits, NotMaterializedLogits)


def test_modernbert_decoder_nested_head_call_is_derived():
    spec = derive_spec(transformers.ModernBertDecoderForCausalLM)
    assert spec.head_attr == "decoder"


def _refitted_roberta_head_forward(self, features, **kwargs):
    """RoBERTa's head computation written anew (the same operations, another source)."""
    x = self.dense(features)
    x = transformers.models.roberta.modeling_roberta.gelu(x)
    x = self.layer_norm(x)
    return self.decoder(x)


def test_the_analysed_head_forwards_are_part_of_the_proof_key(monkeypatch):
    """A different (fitting) head forward proves again: its source is in the fingerprint."""
    from transformers.models.roberta.modeling_roberta import RobertaLMHead

    calls = []
    real = proof.prove
    monkeypatch.setattr(proof, "prove", lambda *a, **k: calls.append(a) or real(*a, **k))
    apply_fused_ce(_build("roberta"), backend="torch")
    apply_fused_ce(_build("roberta", seed=1), backend="torch")
    assert len(calls) == 1  # the memo

    monkeypatch.setattr(RobertaLMHead, "forward", _refitted_roberta_head_forward)
    apply_fused_ce(_build("roberta", seed=2), backend="torch")
    assert len(calls) == 2


def test_prefix_copy_adds_nothing_to_the_modeling_module():
    from transformers.models.bert import modeling_bert

    names = set(vars(modeling_bert))
    model = _build("bert")
    path = head_path_module.head_path(model, "cls", model.get_output_embeddings())
    assert path.names == ("cls", "cls.predictions", "cls.predictions.decoder")
    assert set(vars(modeling_bert)) == names
    hidden = torch.randn(2, 5, 32, dtype=torch.float64)
    want = model.cls.predictions.transform(hidden)
    assert torch.equal(path.prefix(model.cls, hidden), want)


def test_head_forward_with_a_closure_takes_the_stock_path(monkeypatch, spy):
    """A class forward replaced (after a class patch) by a closure: its prefix copy could not
    bind the closed-over names, so the call runs the stock head."""
    from transformers.models.roberta.modeling_roberta import RobertaLMHead

    model = _build("roberta")
    ref = reference_copy(model)
    cls = type(model)
    apply_fused_ce_to_class(cls, backend="torch")
    try:
        monkeypatch.setattr(RobertaLMHead, "forward", _closure_forward())
        batch = _batch()
        with monkeypatch.context() as env:  # the class patch covers ref too: stock path there
            env.setenv("FUSED_CE_RETURN_LOGITS", "1")
            want = _run(ref, batch)
        with pytest.warns(RuntimeWarning, match="closes over scale"):
            got = _run(model, batch)
        assert spy.count == 0
        _assert_same(got, want)
    finally:
        revert_fused_ce(cls)


@pytest.mark.parametrize("targets", [["lm_head.dense", "query"], ["lm_head.decoder", "query"]])
def test_lora_inside_the_transform_or_on_the_projection(targets, spy):
    """PEFT LoRA on the transform's dense layer (run by the head's own code in the fused path)
    or on the projection (folded into the fused loss's operands, hf/head.py)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_build("roberta"), peft.LoraConfig(
        r=4, target_modules=targets, init_lora_weights=False))
    ref = reference_copy(model)
    batch = _batch()
    want = _run(ref, batch)
    apply_fused_ce(model, backend="torch")
    got = _run(model, batch)
    assert spy.count == 1 and isinstance(got[0].logits, NotMaterializedLogits)
    assert any("lora_A" in n for n in want[1])
    _assert_same(got, want)


def test_peft_modules_to_save_on_the_head_module_is_refused():
    """``modules_to_save=["lm_head"]`` wraps the head module in PEFT's wrapper, whose forward
    chooses the copy at run time: not a transform then the projection, refused by name."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_build("roberta"), peft.LoraConfig(
        r=4, target_modules=["query"], modules_to_save=["lm_head"]))
    with pytest.raises(UnsupportedModelError, match=r"calls self\.lm_head.*Wrapper\.forward"):
        apply_fused_ce(model, backend="torch")


def test_compiled_patched_model():
    """torch.compile (aot_eager): the head path's resolution runs eagerly (a graph break, no
    tracing of source reads), the transform's code is compiled; stock's loss and gradients."""
    model = _build("roberta")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    compiled = torch.compile(model, backend="aot_eager")
    batch = _batch()
    want = _run(ref, batch)
    got = _run(compiled, batch)
    assert isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, (want[0], {f"_orig_mod.{k}": v for k, v in want[1].items()}),
                 must=[f"_orig_mod.{k}" for k in TRANSFORM_PARAMS["roberta"]])


def test_deep_copy_of_a_patched_model_keeps_the_head_path(spy):
    model = _build("bert")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    clone = copy.deepcopy(model)
    assert clone._fused_ce_state.head_forwards == model._fused_ce_state.head_forwards
    batch = _batch()
    got, want = _run(clone, batch), _run(ref, batch)
    assert spy.count == 1 and isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, want, must=TRANSFORM_PARAMS["bert"])


@pytest.mark.parametrize("chunk", [0, 4])
def test_reformer_chunked_head_call_matches_stock(chunk, spy):
    # ReformerOnlyLMHead.forward returns apply_chunking_to_forward(self.forward_chunk, ...)
    # and forward_chunk calls the decoder: the same values as one call on every position
    config = transformers.ReformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        feed_forward_size=64, is_decoder=True, axial_pos_embds=False,
        attn_layers=["local", "local"], local_attn_chunk_length=4, chunk_size_lm_head=chunk,
        max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
        # its reversible layers draw dropout seeds from torch.seed() (not reproducible)
        hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.ReformerModelWithLMHead(config).to(torch.float64).train()
    with torch.no_grad():
        model.lm_head.decoder.bias.normal_(0.0, 0.1)  # the decoder bias: its gradient is tested
    ref = reference_copy(model)
    batch = _batch()
    batch.pop("attention_mask")
    want = _run(ref, batch)
    apply_fused_ce(model, backend="torch")
    got = _run(model, batch)
    assert spy.count == 1, "the fused loss did not run"
    assert isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, want, must=("lm_head.decoder.bias",))


def apply_chunking_to_forward(fn, chunk_size, dim, x):  # not transformers': doubles the output
    return fn(x) * 2


class _FakeChunkedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = torch.nn.Linear(4, 5)

    def forward(self, x):
        return apply_chunking_to_forward(self.forward_chunk, 0, 1, x)

    def forward_chunk(self, x):
        return self.decoder(x)


def test_a_chunked_call_through_another_function_is_not_split():
    from fused_ce_patch.hf.head_path import resolve

    head = _FakeChunkedHead()
    found = resolve(head, head.decoder)
    assert isinstance(found, str) and "apply_chunking_to_forward is not transformers'" in found


def _flag_trainer(model, tmp_path):
    """A Trainer with the use_fused_ce flag (the callback patches ``model`` in ``__init__``)."""
    from transformers import Trainer

    from fused_ce_patch import FusedCETrainingArguments

    args = FusedCETrainingArguments(output_dir=str(tmp_path), use_fused_ce=True,
                                    fused_ce_backend="torch", report_to=[], use_cpu=True)
    return Trainer(model=model, args=args)


def test_trainer_flag_proves_a_transform_head_once(monkeypatch, tmp_path):
    """The flag's refusal check and apply_fused_ce prove the same thing (the class with its
    analysed head forwards): one proof, not one per spelling of the key."""
    calls = []
    real = proof.prove
    monkeypatch.setattr(proof, "prove", lambda *a, **k: calls.append(a) or real(*a, **k))
    model = _build("roberta")
    _flag_trainer(model, tmp_path)
    assert is_fused_ce_applied(model)
    assert len(calls) == 1
    _flag_trainer(_build("roberta", seed=1), tmp_path)
    assert len(calls) == 1  # the memo
    assert apply_fused_ce(_build("roberta", seed=2), backend="torch")
    assert len(calls) == 1  # apply_fused_ce reads the flag's proof


def test_trainer_flag_proves_a_changed_head_again(monkeypatch, tmp_path):
    """A head forward that changed since the last proof is proven again under the flag (once)."""
    from transformers.models.roberta.modeling_roberta import RobertaLMHead

    calls = []
    real = proof.prove
    monkeypatch.setattr(proof, "prove", lambda *a, **k: calls.append(a) or real(*a, **k))
    _flag_trainer(_build("roberta"), tmp_path)
    assert len(calls) == 1

    monkeypatch.setattr(RobertaLMHead, "forward", _refitted_roberta_head_forward)
    model = _build("roberta", seed=1)
    _flag_trainer(model, tmp_path)
    assert is_fused_ce_applied(model)
    assert len(calls) == 2


def test_trainer_flag_warns_and_trains_stock_on_a_head_that_does_not_fit(tmp_path, caplog):
    """The flag refuses a head module whose call cannot be split as it refuses every other
    model apply_fused_ce would: one warning naming the reason, the model left stock."""
    import logging

    model = _build("roberta")
    model.lm_head.__class__ = _AddsAfterTheProjection
    with caplog.at_level(logging.WARNING, logger="fused_ce_patch"):
        _flag_trainer(model, tmp_path)
    warned = [r.getMessage() for r in caplog.records if "use_fused_ce" in r.getMessage()]
    assert len(warned) == 1 and "_AddsAfterTheProjection.forward" in warned[0], warned
    assert not is_fused_ce_applied(model)

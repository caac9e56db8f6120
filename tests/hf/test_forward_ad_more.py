"""Forward-mode AD tangents entering through a RoBERTa transform head (dense / layer_norm), a tied
embedding (Qwen2 tie_word_embeddings, RoBERTa decoder), Gemma2's softcapped logits: each gives
stock's JVP; a forward-AD level open with no dual anywhere keeps the fused loss and stock's
loss. Found or checked by an adversarial pass (2026-12-05).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import transformers
from torch.func import functional_call

from fused_ce_patch import apply_fused_ce, fused_linear_cross_entropy
from fused_ce_patch.hf import loss_mapping
from fused_ce_patch.hf.tiny import tiny_config
from hf_helpers import batch, build_model, reference_copy


def _jvp(model, names, b):
    params = dict(model.named_parameters(remove_duplicate=False))
    g = torch.Generator().manual_seed(3)
    with fwAD.dual_level():
        new = {n: fwAD.make_dual(params[n].detach(), torch.randn(params[n].shape, generator=g,
                                                                 dtype=params[n].dtype))
               for n in names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = functional_call(model, new, (), b)
        primal, tangent = fwAD.unpack_dual(out.loss)
        return primal.item(), None if tangent is None else tangent.item()


def _roberta():
    config = tiny_config("roberta")
    config.is_decoder = True
    torch.manual_seed(0)
    return transformers.RobertaForCausalLM(config).double().train()


def _rb_batch(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("names", [["lm_head.dense.weight"], ["lm_head.layer_norm.weight"],
                                   ["lm_head.decoder.weight"], ["lm_head.bias"]])
def test_roberta_transform_head_tangents(names):
    model = _roberta()
    stock = copy.deepcopy(model)
    stock.loss_function = loss_mapping.original_causal_lm_loss()
    apply_fused_ce(model, backend="torch")
    b = _rb_batch(model.config.vocab_size)
    want, got = _jvp(stock, names, b), _jvp(model, names, b)
    assert want[1] is not None and got == pytest.approx(want, rel=1e-7)


@pytest.mark.parametrize("arch,names", [("qwen2", ["model.embed_tokens.weight"]),
                                        ("qwen2", ["lm_head.weight"]),
                                        ("gemma2", ["lm_head.weight"])])
def test_tied_and_softcap_tangents(arch, names):
    model = build_model(arch)
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    want, got = _jvp(ref, names, batch()), _jvp(model, names, batch())
    assert want[1] is not None and got == pytest.approx(want, rel=1e-4)


def test_level_open_without_duals_keeps_fused_loss(spy):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    want = ref(**batch()).loss
    with fwAD.dual_level():
        got = model(**batch(), num_items_in_batch=torch.tensor(20.0)).loss
        got_int = model(**batch(), num_items_in_batch=20).loss
    want_n = ref(**batch(), num_items_in_batch=20).loss
    assert spy.count == 2
    torch.testing.assert_close(got, want_n, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_int, want_n, rtol=1e-5, atol=0)
    assert torch.isfinite(want)


def test_functional_num_items_no_false_positive():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 8, generator=g), torch.randn(11, 8, generator=g)
    y = torch.randint(0, 11, (6,), generator=g)
    base = fused_linear_cross_entropy(h, w, y, num_items_in_batch=torch.tensor(5.0))
    with fwAD.dual_level():
        for n in (5, 5.0, torch.tensor(5.0), torch.tensor(5)):
            torch.testing.assert_close(fused_linear_cross_entropy(h, w, y, num_items_in_batch=n),
                                       base, rtol=1e-6, atol=0)
        # a dual hidden with a plain n: the functional has no jvp (torch's own error), the
        # n check does not fire first
        hd = fwAD.make_dual(h, torch.ones_like(h))
        with pytest.raises(Exception) as info:
            fused_linear_cross_entropy(hd, w, y, num_items_in_batch=torch.tensor(5.0))
        assert "num_items_in_batch" not in str(info.value)

"""Softcaps written as calls, and branches the rewrite leaves to the stock code (issue 37).

Inkling2 caps its logits through a module (``logits = self.logit_softcap(logits)``), xLSTM
through a function (``soft_cap(logits, cap)``) in the ``else`` of an inference-only chunked
branch, and Inkling trims a padded vocabulary under ``if``; all three were refused before. Now
the call is read from the callee's live source at each call (hf/softcap_call.py) and the
branch the fused loss does not express computes the real logits first.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import transformers
from transformers.modeling_outputs import CausalLMOutput

from fused_ce_patch import UnsupportedModelError, apply_fused_ce, revert_fused_ce
from fused_ce_patch.hf import forward as fwd
from fused_ce_patch.hf.architectures import derive_spec
from fused_ce_patch.hf.sentinel import NotMaterializedLogits
from fused_ce_patch.hf.softcap_call import callable_softcap
from fused_ce_patch.hf.tiny import tiny_config
from hf_helpers import assert_step_close, step

pytestmark = pytest.mark.usefixtures("fresh_proofs")  # tests/hf/conftest.py

V = 300


def _model(model_type, cls, dtype=torch.float64, **overrides):
    config = tiny_config(model_type)
    config.vocab_size = V
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return cls(config).to(dtype).train()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # ignored positions
    return {"input_ids": ids, "labels": labels}


_run = step


def _assert_same(got, want):
    # the fused loss differs from stock's only by summation order: ~1e-16 relative in float64,
    # ~1e-7 in float32 (a few hundred terms per sum), so 1e-10 / 1e-5 leave a wide margin
    tol = 1e-10 if want[1].dtype == torch.float64 else 1e-5
    assert_step_close(got, want, tol, tol)


def _inkling2(cap=5.0):
    # its router runs in float32 whatever the model dtype: a float32 model
    return _model("inkling2_text", transformers.Inkling2ForCausalLM, torch.float32,
                  unpadded_vocab_size=V, final_logit_softcapping=cap)


def test_inkling2_module_softcap_is_fused_and_matches_stock():
    spec = derive_spec(transformers.Inkling2ForCausalLM)
    assert spec.transform_name == "softcap", spec.transform
    model, batch = _inkling2(), _batch()
    want = _run(model, batch)
    apply_fused_ce(model, backend="torch")
    seen = []
    real = fwd.materialize
    fwd.materialize = lambda logits, reason: seen.append(reason) or real(logits, reason)
    try:
        got = _run(model, batch)
    finally:
        fwd.materialize = real
    assert seen == []
    assert isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, want)
    # the cap really reached the loss: without it the number differs
    model.logit_softcap.softcap = 1e6
    assert not torch.allclose(_run(model, batch)[1], want[1], rtol=1e-6, atol=0)


def test_inkling2_hooked_or_changed_softcap_module_runs_stock():
    model, batch = _inkling2(), _batch()
    handle = model.logit_softcap.register_forward_hook(lambda m, a, out: out * 0.5)
    want = _run(model, batch)
    apply_fused_ce(model, backend="torch")
    with pytest.warns(RuntimeWarning, match="has hooks"):
        got = _run(model, batch)
    assert not isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, want)
    handle.remove()

    # a forward of another form on the module's class: read at each call, so stock runs
    class Doubled(type(model.logit_softcap)):
        def forward(self, hidden_states):
            return torch.tanh(hidden_states / self.softcap) * self.softcap * 2

    model.logit_softcap.__class__ = Doubled
    with pytest.warns(RuntimeWarning, match="is not `torch.tanh"):
        got = _run(model, batch)
    revert_fused_ce(model)
    _assert_same(got, _run(model, batch))


def _xlstm(**overrides):
    return _model("xlstm", transformers.xLSTMForCausalLM,
                  **{"output_logit_soft_cap": 4.0, **overrides})


def test_xlstm_function_softcap_is_fused_and_matches_stock():
    model, batch = _xlstm(), _batch()
    want = _run(model, batch)
    apply_fused_ce(model, backend="torch")
    got = _run(model, batch)
    assert isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, want)


def test_xlstm_without_cap_and_inference_branch_match_stock():
    model, batch = _xlstm(), _batch()
    # the config class validates a float; the forward's soft_cap accepts None (no cap)
    object.__setattr__(model.config, "output_logit_soft_cap", None)
    want = _run(model, batch)
    apply_fused_ce(model, backend="torch")
    got = _run(model, batch)
    assert isinstance(got[0].logits, NotMaterializedLogits)  # soft_cap(x, None) is x
    _assert_same(got, want)



def _fwd_branch(self, input_ids=None, labels=None, **kwargs):
    hidden_states = self.model(input_ids).last_hidden_state
    logits = self.lm_head(hidden_states)
    if not self.training and logits.shape[1] > self.config.chunk:
        with torch.no_grad():  # xLSTM's chunked inference, in miniature
            logits[:, :1] = logits[:, :1] * 2
    else:
        logits = logits * self.config.scale
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                  **kwargs)
    return CausalLMOutput(loss=loss, logits=logits)


def _llama_config():
    return transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2)


class _Branchy(transformers.LlamaForCausalLM):
    forward = _fwd_branch


# apply_fused_ce patches transformers' own forwards only; this one stands in for such a class
_Branchy.__module__ = "transformers.fused_ce_test_branchy"


def test_if_else_runs_else_ops_fused_and_the_other_branch_on_real_logits():
    config = _llama_config()
    config.chunk, config.scale = 5, 0.5
    torch.manual_seed(0)
    model, batch = _Branchy(config).double().train(), _batch()
    assert derive_spec(_Branchy).transform_name == "multiplier"
    want = _run(model, batch)
    apply_fused_ce(model, backend="torch")
    got = _run(model, batch)
    assert isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, want)
    model.eval()
    with torch.no_grad():
        want_eval = model(**batch).loss  # eval without skip_logits: the stock forward
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="a branch the fused loss"):
        out = model(**batch, skip_logits=True)
    assert not isinstance(out.logits, NotMaterializedLogits)
    torch.testing.assert_close(out.loss, want_eval, rtol=0, atol=0)


def test_inkling_vocab_trim_branch_runs_stock_and_untrimmed_is_fused():
    cls = transformers.InklingForCausalLM
    # its MoE runs grouped matmuls, float32 only
    model = _model("inkling_text", cls, torch.float32, unpadded_vocab_size=None)
    batch = _batch()
    want = _run(model, batch)
    apply_fused_ce(model, backend="torch")
    got = _run(model, batch)
    assert isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, want)

    model = _model("inkling_text", cls, torch.float32, unpadded_vocab_size=V - 20)
    batch = _batch(2)
    batch["labels"] = batch["labels"].clamp(max=V - 21)
    want = _run(model, batch)
    apply_fused_ce(model, backend="torch")
    with pytest.warns(RuntimeWarning, match="a branch the fused loss"):
        got = _run(model, batch)
    assert got[0].logits.shape[-1] == V - 20
    _assert_same(got, want)


def _cap(values, cap=None):
    """doc"""
    if cap is None:
        return values
    return cap * torch.tanh(values / cap)


def _cap_plain(values, cap):
    return torch.tanh(values / cap) * cap


def _not_cap(values, cap):
    return torch.tanh(values / cap) * cap * 2


def test_callable_softcap_reads_only_the_exact_forms():
    assert callable_softcap("capfn", (_cap, 3.0)) == (3.0, None)
    assert callable_softcap("capfn", (_cap, None)) == (None, None)
    assert callable_softcap("capfn", (_cap_plain, 2.0)) == (2.0, None)
    assert callable_softcap("capfn", (_cap_plain, None))[1] == "its softcap operand is None"
    assert callable_softcap("capfn", (_not_cap, 2.0))[1] is not None
    assert callable_softcap("capfn", (torch.clamp, 2.0))[1] is not None
    fake = types.FunctionType(_cap_plain.__code__, {"torch": types.SimpleNamespace(
        tanh=torch.tanh)})
    assert callable_softcap("capfn", (fake, 2.0))[1] is not None  # `torch` is not torch

    module = transformers.models.inkling2.modeling_inkling2.Inkling2Softcap(7.0)
    assert callable_softcap("capcall", module) == (7.0, None)
    module.softcap = None
    assert callable_softcap("capcall", module)[1] is not None
    assert callable_softcap("capcall", torch.nn.Tanh())[1] is not None


def _fwd_if_returns(self, input_ids=None, labels=None, **kwargs):
    logits = self.lm_head(self.model(input_ids).last_hidden_state)
    if logits.shape[1] > 4:
        return logits
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=V, **kwargs)
    return loss


def _fwd_if_reads_values(self, input_ids=None, labels=None, **kwargs):
    logits = self.lm_head(self.model(input_ids).last_hidden_state)
    if logits.max() > 4:
        logits = logits * 2
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=V, **kwargs)
    return loss


@pytest.mark.parametrize("forward", [_fwd_if_returns, _fwd_if_reads_values])
def test_branches_that_return_or_read_the_logits_are_refused(forward):
    cls = type("Odd" + forward.__name__, (transformers.LlamaForCausalLM,), {"forward": forward})
    with pytest.raises(UnsupportedModelError, match="unknown statement between the head"):
        derive_spec(cls)


def test_warnings_are_not_raised_on_the_fused_path():
    model, batch = _inkling2(), _batch()
    apply_fused_ce(model, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(model, batch)


def _fwd_neutral(self, input_ids=None, labels=None, **kwargs):
    hidden_states = self.model(input_ids).last_hidden_state
    logits = self.lm_head(hidden_states)
    self.config.seen = kwargs.pop("note", None)  # stock code that never sees the logits
    logits = logits * self.config.scale
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                  **kwargs)
    return CausalLMOutput(loss=loss, logits=logits)


class _Neutral(transformers.LlamaForCausalLM):
    forward = _fwd_neutral


_Neutral.__module__ = "transformers.fused_ce_test_neutral"


def test_a_statement_that_never_sees_the_logits_runs_in_place():
    config = _llama_config()
    config.scale = 0.5
    torch.manual_seed(0)
    model, batch = _Neutral(config).double().train(), _batch()
    want = _run(model, batch, note="stock")
    apply_fused_ce(model, backend="torch")
    model.config.seen = None
    got = _run(model, batch, note="fused")
    assert model.config.seen == "fused"  # it ran, and `note` did not reach the loss
    assert isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, want)


def _fwd_split_softcap(self, input_ids=None, labels=None, **kwargs):
    logits = self.lm_head(self.model(input_ids).last_hidden_state)
    logits = logits / self.config.cap
    self.config.seen = kwargs.pop("note", None)
    logits = torch.tanh(logits)
    logits = logits * self.config.cap
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=V, **kwargs)
    return loss


def test_a_statement_inside_a_softcap_is_refused():
    cls = type("Split", (transformers.LlamaForCausalLM,), {"forward": _fwd_split_softcap})
    with pytest.raises(UnsupportedModelError, match="inside the softcap"):
        derive_spec(cls)

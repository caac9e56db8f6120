"""Loss blocks beyond ``self.loss_function(...)`` (hf/architectures.py, hf/forward.py).

1. The ``CrossEntropyLoss`` block of the BART family, CPM-Ant, TrOCR, Whisper, XLNet::

       if labels is not None:
           labels = labels.to(logits.device)        # not in every class
           loss_fct = CrossEntropyLoss()
           loss = loss_fct(logits.view(-1, self.config.vocab_size), labels.view(-1))

   an unshifted mean over counted rows in the logits' dtype; NaN when none counts.
2. Extra terms after the loss call: Bamba's z-loss, the mean over every kept position of
   ``logsumexp(logits)**2``, computed without logits.

Tolerances. The ``CrossEntropyLoss`` form computes in the model dtype on both sides: in float64
the two differ only by summation order over V and N (relative ~1e-16 per term, measured
≤ 1e-14 on these models), so 1e-12 for the loss and the gradients. Bamba's loss goes through
transformers' ``ForCausalLMLoss``, which rounds the logits to float32 on the stock side (and
its z-loss casts the log-sum-exp to float32): 1e-6 for the loss, 1e-5 for gradients, as the
proof's float64 tolerances (hf/proof.py). Gradients are compared relative to the largest
gradient norm times 1e-3 at least, as the proof does (a gradient zero in exact arithmetic is
rounding noise).
"""

from __future__ import annotations

import copy
import functools
import importlib
import warnings

import pytest
import torch
import transformers
from transformers.modeling_outputs import CausalLMOutput

from fused_ce_patch import UnsupportedModelError, apply_fused_ce
from fused_ce_patch.hf import architectures
from fused_ce_patch.hf import head as hf_head
from fused_ce_patch.hf.proof import proving
from fused_ce_patch.hf.sentinel import NotMaterializedLogits
from fused_ce_patch.hf.tiny import tiny_config

pytestmark = pytest.mark.usefixtures("fresh_proofs")  # tests/hf/conftest.py

CE_TOL = 1e-12
FLOAT32_LOSS_TOL, FLOAT32_GRAD_TOL = 1e-6, 1e-5

# model_type -> (class name, modeling module)
CE_TYPES = {
    "bart": ("BartForCausalLM", "transformers.models.bart.modeling_bart"),
    "whisper": ("WhisperForCausalLM", "transformers.models.whisper.modeling_whisper"),
    "trocr": ("TrOCRForCausalLM", "transformers.models.trocr.modeling_trocr"),
    "cpmant": ("CpmAntForCausalLM", "transformers.models.cpmant.modeling_cpmant"),
}


def _build(model_type, **overrides):
    config = tiny_config(model_type)
    for k in ("encoder_attention_heads", "decoder_attention_heads"):
        if hasattr(config, k):  # the sweep's shrink leaves 6 or 12 heads on a width of 64
            setattr(config, k, 4)
    for k, v in overrides.items():
        setattr(config, k, v)
    cls = getattr(transformers, CE_TYPES[model_type][0] if model_type in CE_TYPES
                  else "BambaForCausalLM")
    torch.manual_seed(0)
    model = cls(config).to(torch.float64).train()
    return model, config


def _vocab(config):
    return config.vocab_size


def _batch(config, seed=1, all_ignored=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, _vocab(config), (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    labels[1, 7:] = -100  # padding
    if all_ignored:
        labels[:] = -100
    return {"input_ids": ids, "labels": labels}


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(**batch)
    if out.loss is not None and out.loss.requires_grad:
        out.loss.backward()
    grads = {k: None if p.grad is None else p.grad.detach().clone()
             for k, p in model.named_parameters()}
    return out, grads


def _assert_same(out, grads, want_out, want_grads, loss_tol, grad_tol):
    assert out.loss.dtype == want_out.loss.dtype
    if torch.isnan(want_out.loss):
        assert torch.isnan(out.loss)
    else:
        err = ((out.loss - want_out.loss).abs() / want_out.loss.abs()).item()
        assert err <= loss_tol, (out.loss.item(), want_out.loss.item(), err)
    assert grads.keys() == want_grads.keys()
    norms = [w.norm() for w in want_grads.values() if w is not None]
    floor = 1e-3 * max(norms) if norms else 0.0
    for k, w in want_grads.items():
        g = grads[k]
        assert (g is None) == (w is None), k
        if w is None:
            continue
        assert torch.isfinite(g).all() == torch.isfinite(w).all(), k
        diff = (g - w).norm()
        assert diff <= grad_tol * max(w.norm(), floor, 1e-300), (k, diff.item(), w.norm().item())


def _stock_and_patched(model):
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    return stock, model


@pytest.mark.parametrize("model_type", list(CE_TYPES))
def test_cross_entropy_block_is_fused_and_matches_stock_in_float64(model_type, spy):
    model, config = _build(model_type)
    assert architectures.derive_spec(type(model)).loss_form == "cross_entropy"
    stock, patched = _stock_and_patched(model)
    batch = _batch(config)
    want_out, want_grads = _run(stock, batch)
    spy.calls.clear()
    out, grads = _run(patched, batch)
    assert isinstance(out.logits, NotMaterializedLogits)
    assert len(spy.calls) == 1
    assert spy.calls[0]["shift"] is False  # the stock loss is unshifted
    assert out.loss.dtype == torch.float64  # the logits' dtype, as stock
    _assert_same(out, grads, want_out, want_grads, CE_TOL, CE_TOL)


@pytest.mark.parametrize("model_type", ["bart", "cpmant", "whisper"])
def test_cross_entropy_block_all_labels_ignored_is_nan_as_stock(model_type):
    model, config = _build(model_type)
    stock, patched = _stock_and_patched(model)
    batch = _batch(config, all_ignored=True)
    want_out, want_grads = _run(stock, batch)
    assert torch.isnan(want_out.loss)  # stock: 0 / 0
    out, grads = _run(patched, batch)
    assert isinstance(out.logits, NotMaterializedLogits)
    _assert_same(out, grads, want_out, want_grads, CE_TOL, CE_TOL)


class _SubclassCE(torch.nn.CrossEntropyLoss):
    pass


@pytest.mark.parametrize("replacement", [
    _SubclassCE,
    functools.partial(torch.nn.CrossEntropyLoss, label_smoothing=0.1),
], ids=["subclass", "label_smoothing"])
@pytest.mark.parametrize("model_type", ["bart", "cpmant"])
def test_replaced_cross_entropy_global_takes_the_stock_path(model_type, replacement,
                                                           monkeypatch):
    model, config = _build(model_type)
    stock, patched = _stock_and_patched(model)
    module = importlib.import_module(CE_TYPES[model_type][1])
    monkeypatch.setattr(module, "CrossEntropyLoss", replacement)
    batch = _batch(config)
    want_out, want_grads = _run(stock, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, grads = _run(patched, batch)
    assert isinstance(out.logits, torch.Tensor) and not isinstance(out.logits,
                                                                    NotMaterializedLogits)
    assert any("runs its stock forward" in str(w.message) for w in caught)
    torch.testing.assert_close(out.logits, want_out.logits, rtol=0, atol=0)
    _assert_same(out, grads, want_out, want_grads, 0.0, 0.0)  # the stock computation itself


@pytest.mark.parametrize("model_type", ["bart", "whisper", "cpmant"])
def test_no_labels_runs_stock(model_type):
    model, config = _build(model_type)
    stock, patched = _stock_and_patched(model)
    batch = {"input_ids": _batch(config)["input_ids"]}
    want = stock(**batch)
    got = patched(**batch)
    assert got.loss is None and want.loss is None
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)


def test_vocab_size_not_the_heads_raises_as_stock():
    # BART reads config.vocab_size at each call: stock's `.view(-1, V)` raises for a wrong V
    model, config = _build("bart")
    stock, patched = _stock_and_patched(model)
    batch = _batch(config)
    for m in (stock, patched):
        m.config.vocab_size += 7
    with pytest.raises(RuntimeError) as want:
        stock(**batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError) as got:
            patched(**batch)
    assert str(got.value) == str(want.value)


def test_int32_labels_take_the_stock_path():
    model, config = _build("bart")
    stock, patched = _stock_and_patched(model)
    batch = _batch(config)
    batch["labels"] = batch["labels"].int()
    with pytest.raises(RuntimeError) as want:
        stock(**batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError) as got:
            patched(**batch)
    assert str(got.value) == str(want.value)


# -- Bamba: the z-loss after the loss call ---------------------------------------------------


@pytest.mark.parametrize("z_loss", [0.0, 0.25])
def test_bamba_z_loss_matches_stock(z_loss, spy, monkeypatch):
    model, config = _build("bamba", z_loss_coefficient=z_loss)
    assert model.z_loss_coefficient == z_loss
    spec = architectures.derive_spec(type(model))
    assert spec.loss_form == "loss_function" and spec.extra_terms
    lse_calls = []
    real_stats = hf_head.fused_linear_token_stats

    def counting(*args, **kwargs):
        if not proving():
            lse_calls.append(kwargs)
        return real_stats(*args, **kwargs)

    monkeypatch.setattr(hf_head, "fused_linear_token_stats", counting)
    stock, patched = _stock_and_patched(model)
    batch = _batch(config)
    want_out, want_grads = _run(stock, batch)
    spy.calls.clear()
    lse_calls.clear()
    out, grads = _run(patched, batch)
    assert isinstance(out.logits, NotMaterializedLogits)
    assert len(spy.calls) == 1
    assert len(lse_calls) == (1 if z_loss > 0 else 0)  # the z-loss without logits
    _assert_same(out, grads, want_out, want_grads, FLOAT32_LOSS_TOL, FLOAT32_GRAD_TOL)
    if z_loss > 0:  # the term matters: without it the loss differs by more than the tolerance
        without = stock.loss_function(logits=stock.lm_head(
            stock.model(input_ids=batch["input_ids"]).last_hidden_state),
            labels=batch["labels"], vocab_size=config.vocab_size)
        assert (without - want_out.loss).abs() > 1e3 * FLOAT32_LOSS_TOL * want_out.loss.abs()


def test_bamba_z_loss_all_labels_ignored_is_nan_as_stock():
    model, config = _build("bamba", z_loss_coefficient=0.25)
    stock, patched = _stock_and_patched(model)
    batch = _batch(config, all_ignored=True)
    want_out, want_grads = _run(stock, batch)
    assert torch.isnan(want_out.loss)
    out, grads = _run(patched, batch)
    assert isinstance(out.logits, NotMaterializedLogits)
    assert torch.isnan(out.loss)
    # stock's NaN loss back-propagates NaN through the z-loss term on both sides
    for k, w in want_grads.items():
        g = grads[k]
        assert (g is None) == (w is None), k
        if w is not None:
            assert torch.equal(torch.isnan(g), torch.isnan(w)), k


class _Identity(torch.nn.Module):
    def forward(self, weight):
        return weight * 1.0


@pytest.mark.parametrize("refusal", ["parametrized_head", "lse_refused"])
def test_bamba_z_loss_takes_real_logits_where_the_fused_lse_cannot(refusal, monkeypatch):
    # A parametrized head: the fused loss evaluates its weight once (hf/head.py), but the fused
    # log-sum-exp would read it a second time, so that term takes real logits (one warning).
    model, config = _build("bamba", z_loss_coefficient=0.25)
    if refusal == "parametrized_head":
        torch.nn.utils.parametrize.register_parametrization(model.lm_head, "weight",
                                                            _Identity())
    stock, patched = _stock_and_patched(model)
    if refusal == "lse_refused":
        from fused_ce_patch.hf import forward

        monkeypatch.setattr(forward, "fused_head_lse", _refuse_lse)
    batch = _batch(config)
    want_out, want_grads = _run(stock, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, grads = _run(patched, batch)
    assert any("runs its stock forward" in str(w.message) for w in caught)
    assert isinstance(out.logits, torch.Tensor) and not isinstance(out.logits,
                                                                    NotMaterializedLogits)
    torch.testing.assert_close(out.logits, want_out.logits, rtol=0, atol=0)
    _assert_same(out, grads, want_out, want_grads, FLOAT32_LOSS_TOL, FLOAT32_GRAD_TOL)


def _refuse_lse(*args, **kwargs):
    raise UnsupportedModelError("the head is not plain (test)")


# -- what the rewrite accepts and refuses ------------------------------------------------------


def _derive(fn):
    return architectures._derive(type("M", (), {"forward": fn}), fn)


def _ce_forward(self, input_ids=None, labels=None, **kwargs):
    hidden_states = self.model(input_ids).last_hidden_state
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        labels = labels.to(logits.device)
        loss_fct = CrossEntropyLoss()  # noqa: F821 - resolved in the module at run time
        loss = loss_fct(logits.view(-1, self.config.vocab_size), labels.view(-1))
    return CausalLMOutput(loss=loss, logits=logits)


def _ce_forward_weighted(self, input_ids=None, labels=None, **kwargs):
    hidden_states = self.model(input_ids).last_hidden_state
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss_fct = CrossEntropyLoss()  # noqa: F821
        loss = loss_fct(logits.view(-1, self.config.vocab_size), labels.view(-1))
        loss = loss * logits.mean()
    return CausalLMOutput(loss=loss, logits=logits)


def _ce_forward_extra_statement(self, input_ids=None, labels=None, **kwargs):
    hidden_states = self.model(input_ids).last_hidden_state
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss_fct = CrossEntropyLoss()  # noqa: F821
        labels = labels[:, 1:]
        loss = loss_fct(logits.view(-1, self.config.vocab_size), labels.reshape(-1))
    return CausalLMOutput(loss=loss, logits=logits)


def _lf_forward_other_term(self, input_ids=None, labels=None, **kwargs):
    hidden_states = self.model(input_ids).last_hidden_state
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=3, **kwargs)
        loss = loss + logits.pow(2).mean()
    return CausalLMOutput(loss=loss, logits=logits)


def test_rewrite_accepts_the_cross_entropy_block_and_names_what_it_refuses():
    spec = _derive(_ce_forward)
    assert spec.loss_form == "cross_entropy" and spec.extra_terms == ()
    with pytest.raises(UnsupportedModelError, match=r"does more than the loss call.*"
                                                    r"logits\.mean"):
        _derive(_ce_forward_weighted)
    with pytest.raises(UnsupportedModelError, match=r"unknown statement in the "
                                                    r"CrossEntropyLoss block.*labels\[:, 1:\]"):
        _derive(_ce_forward_extra_statement)
    with pytest.raises(UnsupportedModelError, match=r"does more than the loss call.*"
                                                    r"logits\.pow"):
        _derive(_lf_forward_other_term)


@pytest.mark.parametrize("dtype,autocast,tol", [
    (torch.float32, False, 1e-5),     # float32 accumulation on both sides, N*V-term sums
    (torch.bfloat16, False, 2e-2),    # stock computes in bfloat16 (8-bit mantissa: 2^-7)
    (torch.float32, True, 2e-2),      # CPU autocast: bfloat16 logits, float32 cross_entropy
], ids=["float32", "bfloat16", "autocast"])
def test_cross_entropy_block_loss_dtype_is_stocks(dtype, autocast, tol):
    model, config = _build("bart")
    model = model.to(dtype)
    stock, patched = _stock_and_patched(model)
    batch = _batch(config)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = stock(**batch)
        got = patched(**batch)
    assert isinstance(got.logits, NotMaterializedLogits)
    assert got.loss.dtype == want.loss.dtype
    assert want.loss.dtype == (torch.float32 if autocast else dtype)
    err = ((got.loss.double() - want.loss.double()).abs() / want.loss.double().abs()).item()
    assert err <= tol, err


def test_proof_holds_the_cross_entropy_form_to_float64_exactness(monkeypatch):
    # Stock computes this loss in float64 too, so the proof's float64 tolerance for the form is
    # 1e-10 (hf/proof.py EXACT_TOLERANCES), not the 1e-6 that ForCausalLMLoss's float32
    # rounding forces on the other classes: a relative error of 1e-8 is refused.
    from fused_ce_patch.hf import forward

    real = forward.fused_module_ce_loss
    monkeypatch.setattr(forward, "fused_module_ce_loss",
                        lambda *a, **k: real(*a, **k) * (1 + 1e-8))
    model, _ = _build("bart")
    with pytest.raises(UnsupportedModelError, match="does not reproduce"):
        apply_fused_ce(model, backend="torch")


def test_cross_entropy_block_ignores_the_models_loss_function_as_stock_does(spy):
    # BART's forward never calls self.loss_function: a custom one changes nothing on either side
    model, config = _build("bart")
    stock, patched = _stock_and_patched(model)

    def custom(logits, labels, **kwargs):
        raise AssertionError("not called by this forward")

    for m in (stock, patched):
        m.loss_function = custom
    batch = _batch(config)
    want_out, want_grads = _run(stock, batch)
    spy.calls.clear()
    out, grads = _run(patched, batch)
    assert isinstance(out.logits, NotMaterializedLogits) and len(spy.calls) == 1
    _assert_same(out, grads, want_out, want_grads, CE_TOL, CE_TOL)


@pytest.mark.parametrize("extra,error", [(7, RuntimeError), (None, ValueError)],
                         ids=["not_a_divisor", "a_divisor"])
def test_vocab_size_unseen_before_the_loss_raises_stocks_error_type(extra, error):
    # Where the rows cannot be checked before the loss (a tensor-parallel head's DTensor), the
    # loss checks after: stock's `.view(-1, V)` raises RuntimeError when V does not divide
    # N * rows, cross_entropy a ValueError (batch sizes) when it does.
    from fused_ce_patch.hf import forward

    model, config = _build("bart")
    stock, patched = _stock_and_patched(model)
    batch = _batch(config)
    rows = model.lm_head.weight.shape[0]
    wrong = rows + extra if extra is not None else rows // 2 if rows % 2 == 0 else rows * 2
    for m in (stock, patched):
        m.config.vocab_size = wrong
    with pytest.raises(error):
        stock(**batch)
    real_refusal = forward._loss_refusal
    with pytest.MonkeyPatch.context() as mp:  # as if the rows were not readable then
        mp.setattr(forward, "_loss_refusal", lambda lg, t, s, v, n: real_refusal(lg, t, s, None, n))
        with pytest.raises(error):
            patched(**batch)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_head_lse_matches_logsumexp_of_the_logits(bias):
    # float64 on both sides: summation order only (1e-12 relative)
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(24, 97, bias=bias).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(97, 24, generator=g, dtype=torch.float64))
        if bias:
            head.bias.copy_(torch.randn(97, generator=g, dtype=torch.float64))
    hidden = torch.randn(3, 5, 24, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 5, generator=g, dtype=torch.float64)

    def grads(lse):
        params = [hidden, *head.parameters()]
        return torch.autograd.grad((lse * upstream).sum(), params)

    want = head(hidden).logsumexp(dim=-1)
    got = hf_head.fused_head_lse(head, hidden, backend="torch")
    assert got.shape == want.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for a, b in zip(grads(got), grads(want)):
        assert (a - b).norm() <= 1e-12 * b.norm()


def test_fused_head_lse_refuses_a_head_it_cannot_read_directly():
    head = torch.nn.Linear(8, 11).double()
    torch.nn.utils.parametrize.register_parametrization(head, "weight", _Identity())
    with pytest.raises(UnsupportedModelError, match="parametrized"):
        hf_head.fused_head_lse(head, torch.randn(2, 8, dtype=torch.float64))

"""Adversarial cases for the forward forms learned for issue 37 (head transforms, the
``CrossEntropyLoss`` block and extra loss terms, softcap calls, positions of the deferred logits).

Each test builds the stock model, a patched copy with the same weights, runs both on one batch
and compares the loss and every gradient, or the exception, with what stock gives.

Tolerances. Models run in float64 unless a test says otherwise. Against transformers'
``ForCausalLMLoss`` (which rounds the float64 logits to float32; the patched model's own logits
loss sums in another order), 1e-6 for the loss and 1e-5 for gradients, the proof's float64
tolerances (hf/proof.py), gradients relative to at least 1e-3 of the largest gradient norm (a
gradient zero in exact arithmetic is rounding noise). Inkling2 runs in float32 (its router
does): 1e-5 / 1e-4, the float32 tolerances of tests/hf/hf_helpers.py.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import transformers

from fused_ce_patch import apply_fused_ce
from fused_ce_patch.hf.sentinel import NotMaterializedLogits
from fused_ce_patch.hf.tiny import tiny_config

pytestmark = pytest.mark.usefixtures("fresh_proofs")  # tests/hf/conftest.py

LOSS_TOL, GRAD_TOL = 1e-6, 1e-5


def _model(model_type, cls, dtype=torch.float64, vocab=None, **overrides):
    config = tiny_config(model_type)
    if vocab is not None:
        config.vocab_size = vocab
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return cls(config).to(dtype).train()


def _batch(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    labels[1, 7:] = -100  # padding
    return {"input_ids": ids, "labels": labels}


def _run(model, batch, seed=5):
    """Loss, outputs and every gradient of one step; the RNG seeded (dropout)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**batch)
    out.loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()
             if p.grad is not None}
    return out, grads


def _assert_same(got, want, loss_tol=LOSS_TOL, grad_tol=GRAD_TOL):
    (out, grads), (want_out, want_grads) = got, want
    assert out.loss.dtype == want_out.loss.dtype
    torch.testing.assert_close(out.loss, want_out.loss, rtol=loss_tol, atol=0)
    assert grads.keys() == want_grads.keys()
    floor = 1e-3 * max(w.norm() for w in want_grads.values())
    for k, w in want_grads.items():
        diff = (grads[k] - w).norm()
        assert diff <= grad_tol * max(w.norm(), floor), (k, diff.item(), w.norm().item())


def _quiet_run(model, batch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _run(model, batch)
    return result, [str(w.message) for w in caught]


# -- extra loss terms: one head call for the loss and the term --------------------------------


def test_bamba_z_loss_with_a_lora_dropout_head_reads_one_head_call_as_stock():
    # Stock calls the head once: the loss and the z-loss see the same LoRA dropout mask. The
    # fused loss read the head (one dropout draw) and the z-loss then materialised the logits
    # with a second head call (another mask): loss 12.49 vs stock 12.58 in float32, the LoRA
    # gradients 40 % off. Now the loss call takes real logits when an extra term will need
    # them from a head that is not a plain nn.Linear.
    peft = pytest.importorskip("peft")
    base = _model("bamba", transformers.BambaForCausalLM, z_loss_coefficient=0.25)
    config = peft.LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=0.3,
                             init_lora_weights=False)
    torch.manual_seed(3)
    model = peft.get_peft_model(base, config)
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    batch = _batch(base.config.vocab_size)
    want = _run(stock, batch)
    got, caught = _quiet_run(model, batch)
    # the stock computation from the head call on (the patched model's logits loss sums in
    # another order than ForCausalLMLoss: float32 rounding)
    _assert_same(got, want)
    assert any("extra loss term" in m for m in caught), caught
    assert not isinstance(got[0].logits, NotMaterializedLogits)
    # and the RNG stream after the step is stock's (one dropout draw, not two)
    torch.manual_seed(5)
    stock(**batch)
    after_stock = torch.rand(4)
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(**batch)
    torch.testing.assert_close(torch.rand(4), after_stock, rtol=0, atol=0)


# -- softcaps written as calls: the callee read is the callee that runs ------------------------

XLSTM_VOCAB = 300


def _xlstm():
    return _model("xlstm", transformers.xLSTMForCausalLM, vocab=XLSTM_VOCAB,
                  output_logit_soft_cap=4.0)


def _doubling(fn):
    @functools.wraps(fn)  # inspect.getsource(wrapper) reads fn's source
    def soft_cap(values, cap_value=None):
        return fn(values, cap_value) * 2.0
    return soft_cap


class _HalfTanh:
    @staticmethod
    def tanh(x):
        return torch.tanh(x) * 0.5


def _closure_torch(fn):
    torch = _HalfTanh()  # the closure's `torch`, not the module global the check reads

    def soft_cap(values, cap_value=None):
        if cap_value is None:
            return values
        return cap_value * torch.tanh(values / cap_value)
    return soft_cap


@pytest.mark.parametrize("replace", [_doubling, _closure_torch], ids=["decorated", "closure"])
def test_xlstm_softcap_function_that_is_not_its_source_runs_stock(replace, monkeypatch):
    # Before: a functools.wraps wrapper was read as the function it wraps, and a closure's
    # `torch` as the module's: the fused loss capped where stock computed something else
    # (float32: loss 5.72 vs 6.12 for the doubling wrapper).
    from transformers.models.xlstm import modeling_xlstm

    model = _xlstm()
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    monkeypatch.setattr(modeling_xlstm, "soft_cap", replace(modeling_xlstm.soft_cap))
    batch = _batch(XLSTM_VOCAB)
    want = _run(stock, batch)
    got, caught = _quiet_run(model, batch)
    _assert_same(got, want)
    assert not isinstance(got[0].logits, NotMaterializedLogits)
    assert any("is not a softcap it can read" in m for m in caught), caught


def _inkling2():
    # its router runs in float32 whatever the model dtype: a float32 model (tolerances: the
    # stock path runs, the patched logits loss sums in another order, float32 rounding ~1e-7)
    return _model("inkling2_text", transformers.Inkling2ForCausalLM, torch.float32,
                  vocab=XLSTM_VOCAB, unpadded_vocab_size=XLSTM_VOCAB,
                  final_logit_softcapping=5.0)


def _own_call_class(base):
    class OwnCall(base):
        def __call__(self, x):  # runs around the class forward, which has the softcap form
            return super().__call__(x) * 2.0
    return OwnCall


def _decorated_forward_class(base):
    class Decorated(base):
        @functools.wraps(base.forward)  # inspect.getsource reads base.forward
        def forward(self, hidden_states):
            return base.forward(self, hidden_states) * 2.0
    return Decorated


@pytest.mark.parametrize("make", [_own_call_class, _decorated_forward_class],
                         ids=["own_call", "decorated_forward"])
def test_inkling2_softcap_module_whose_call_is_not_its_forward_source_runs_stock(make):
    # Before: the module's class forward source had the softcap form, so the fused loss capped;
    # stock's call doubled the capped logits (float32 loss 5.72 vs 5.77).
    model = _inkling2()
    model.logit_softcap.__class__ = make(type(model.logit_softcap))
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    batch = _batch(XLSTM_VOCAB)
    want = _run(stock, batch)
    got, caught = _quiet_run(model, batch)
    _assert_same(got, want, 1e-5, 1e-4)
    assert not isinstance(got[0].logits, NotMaterializedLogits)
    assert any("runs its stock forward" in m for m in caught), caught


def test_softcap_function_changed_on_disk_after_import_runs_stock(tmp_path, monkeypatch):
    # The source read must be the code that runs: a module edited after import (a notebook
    # session, a hot-patched file) shows linecache the new text.
    import importlib.util
    import linecache

    from transformers.models.xlstm import modeling_xlstm

    path = tmp_path / "edited_softcap.py"
    path.write_text("import torch\n\n\ndef soft_cap(values, cap_value=None):\n"
                    "    if cap_value is None:\n        return values\n"
                    "    return cap_value * torch.tanh(values / cap_value) * 2.0\n")
    spec = importlib.util.spec_from_file_location("edited_softcap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path.write_text("import torch\n\n\ndef soft_cap(values, cap_value=None):\n"
                    "    if cap_value is None:\n        return values\n"
                    "    return cap_value * torch.tanh(values / cap_value)\n")
    linecache.checkcache(str(path))
    model = _xlstm()
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    monkeypatch.setattr(modeling_xlstm, "soft_cap", module.soft_cap)
    batch = _batch(XLSTM_VOCAB)
    want = _run(stock, batch)
    got, _ = _quiet_run(model, batch)
    _assert_same(got, want)
    assert not isinstance(got[0].logits, NotMaterializedLogits)


# -- a head with a transform: its source read as written --------------------------------------


class _DocumentedHead(transformers.models.roberta.modeling_roberta.RobertaLMHead):
    def forward(self, features, **kwargs):
        """Dense, GELU, layer norm, then the vocabulary projection.

        An indented docstring: dedenting the source changed this constant, and a call of a
        module attribute (``torch.nn.functional.gelu``) compiles to another instruction in a
        ``def`` compiled alone; either made the head read as "changed since import".
        """
        x = self.dense(features)
        x = torch.nn.functional.gelu(x)
        x = self.layer_norm(x)
        return self.decoder(x)


def test_head_forward_with_a_docstring_and_a_module_call_is_fused(spy):
    # Before: apply_fused_ce refused this head (UnsupportedModelError: "its code is not the
    # code of its source file (changed since import?)"), though its source is what runs.
    config = tiny_config("roberta")
    config.vocab_size, config.is_decoder = 97, True
    torch.manual_seed(0)
    model = transformers.RobertaForCausalLM(config).to(torch.float64).train()
    model.lm_head.__class__ = _DocumentedHead
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    batch = _batch(97)
    want = _run(stock, batch)
    spy.calls.clear()
    got, caught = _quiet_run(model, batch)
    assert isinstance(got[0].logits, NotMaterializedLogits), caught
    assert len(spy.calls) == 1
    _assert_same(got, want)


def test_head_module_replaced_after_the_patch_runs_the_stock_head_call():
    # RoBERTa's get_output_embeddings() returns self.lm_head.decoder; once lm_head is replaced
    # by a plain Linear it raises AttributeError. Stock's forward never calls it and trains;
    # before, the patched forward raised that AttributeError.
    config = tiny_config("roberta")
    config.vocab_size, config.is_decoder = 97, True
    torch.manual_seed(0)
    model = transformers.RobertaForCausalLM(config).to(torch.float64).train()
    apply_fused_ce(model, backend="torch")
    torch.manual_seed(4)
    model.lm_head = torch.nn.Linear(config.hidden_size, 97, dtype=torch.float64)
    stock = copy.deepcopy(model)
    from fused_ce_patch import revert_fused_ce

    revert_fused_ce(stock)
    batch = _batch(97)
    want = _run(stock, batch)
    got, caught = _quiet_run(model, batch)
    _assert_same(got, want)
    assert not isinstance(got[0].logits, NotMaterializedLogits)
    assert any("get_output_embeddings() raises AttributeError" in m for m in caught), caught


def test_compiled_xlstm_softcap_call_is_read_eagerly(monkeypatch):
    # Under torch.compile the softcap check was traced: Dynamo warned of tracing through
    # functools.lru_cache ("silent incorrectness ... potential risk"), and its stock-path
    # message named "<attribute '__qualname__' of 'function' objects>". The check now runs
    # eagerly (a graph break), as the head path's does.
    from transformers.models.xlstm import modeling_xlstm

    torch._dynamo.reset()
    model = _xlstm()
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    compiled = torch.compile(model, backend="aot_eager")
    batch = _batch(XLSTM_VOCAB)
    want = _run(stock, batch)
    got, caught = _quiet_run(compiled, batch)
    grads = {k.replace("_orig_mod.", ""): g for k, g in got[1].items()}
    _assert_same((got[0], grads), want)
    assert isinstance(got[0].logits, NotMaterializedLogits)
    assert not any("lru_cache" in m for m in caught), caught
    # a softcap function replaced after compiling is read at the next call
    monkeypatch.setattr(modeling_xlstm, "soft_cap", _doubling(modeling_xlstm.soft_cap))
    want = _run(stock, batch)
    got, caught = _quiet_run(compiled, batch)
    grads = {k.replace("_orig_mod.", ""): g for k, g in got[1].items()}
    _assert_same((got[0], grads), want)
    assert any("'soft_cap' on its logits is not a softcap" in m for m in caught), caught
    torch._dynamo.reset()


@pytest.mark.parametrize("z_loss", [0.0, 0.25])
def test_bamba_with_a_deterministic_lora_head_keeps_the_fused_loss(z_loss, spy):
    # No dropout in the LoRA head: a second head call for the z-loss gives the same logits,
    # so the loss stays fused (the memory saving kept); the z-loss reads real logits.
    peft = pytest.importorskip("peft")
    base = _model("bamba", transformers.BambaForCausalLM, z_loss_coefficient=z_loss)
    config = peft.LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=0.0,
                             init_lora_weights=False)
    torch.manual_seed(3)
    model = peft.get_peft_model(base, config)
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    batch = _batch(base.config.vocab_size)
    want = _run(stock, batch)
    spy.calls.clear()
    got, _ = _quiet_run(model, batch)
    _assert_same(got, want)
    assert len(spy.calls) == 1  # the loss itself was fused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_lse_in_16_bit_is_the_lse_of_the_rounded_logits(dtype):
    # Stock's z-loss takes logsumexp of its 16-bit logits (the product rounded to the dtype).
    # The fused log-sum-exp is z_0 - log p_0 with log p_0 from the kernel's (rounded) logits;
    # z_0 was the unrounded product, so every position carried z_0's rounding (up to
    # |z_0| 2**-9 in bfloat16: 3e-2 here), making Bamba's bf16 z-loss up to 3x further from
    # float64 than stock's. Now z_0 is rounded as the kernel's logits are: the two agree to
    # float32 summation (V = 1000 terms of |z| < 100: ~1e-6 absolute; 2e-5 leaves margin).
    from fused_ce_patch.hf.head import fused_head_lse

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 1000, bias=False).to(dtype)
    hidden = (torch.randn(256, 64) * 8).to(dtype)
    want = torch.nn.functional.linear(hidden, head.weight).float().logsumexp(-1)
    got = fused_head_lse(head, hidden, backend="torch")
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 2e-5


def _doubled_dense_forward(self, features, **kwargs):
    # only its code is used, run with modeling_roberta's globals (its `gelu`)
    x = self.dense(features) * 2.0
    x = gelu(x)  # noqa: F821
    x = self.layer_norm(x)
    return self.decoder(x)


def test_head_forward_code_replaced_in_place_is_read_again(monkeypatch):
    # IPython's %autoreload swaps a function's __code__ in place. The head path was cached per
    # function object, so the fused loss kept running the old transform while stock ran the
    # new one. Now the analysis is cached per code object too.
    from transformers.models.roberta.modeling_roberta import RobertaLMHead

    config = tiny_config("roberta")
    config.vocab_size, config.is_decoder = 97, True
    torch.manual_seed(0)
    model = transformers.RobertaForCausalLM(config).to(torch.float64).train()
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    batch = _batch(97)
    _run(model, batch)  # the head path analysed and cached
    monkeypatch.setattr(RobertaLMHead.forward, "__code__", _doubled_dense_forward.__code__)
    want = _run(stock, batch)
    got, caught = _quiet_run(model, batch)
    _assert_same(got, want)
    assert isinstance(got[0].logits, NotMaterializedLogits), caught


def test_hooked_head_module_warning_names_the_attribute():
    # The warning read "its head module the head module (...)"; it now names the attribute.
    config = tiny_config("roberta")
    config.vocab_size, config.is_decoder = 97, True
    torch.manual_seed(0)
    model = transformers.RobertaForCausalLM(config).to(torch.float64).train()
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, stock):
        m.lm_head.register_forward_hook(lambda mod, args, out: out * 1.5)
    batch = _batch(97)
    want = _run(stock, batch)
    got, caught = _quiet_run(model, batch)
    _assert_same(got, want)
    assert any("its head module lm_head (RobertaLMHead has forward hooks)" in m
               for m in caught), caught


@pytest.mark.parametrize("model_type", ["roberta", "llama"])
def test_shift_labels_that_cannot_be_viewed_flat_raise_as_stock(model_type):
    # ForCausalLMLoss takes shift_labels.view(-1): a non-contiguous tensor of the right shape
    # raises RuntimeError there. The fused loss reshaped it and returned a loss.
    config = tiny_config(model_type)
    config.vocab_size = 97
    if model_type == "roberta":
        config.is_decoder = True
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64).train()
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    batch = _batch(97)
    wide = torch.cat([batch["labels"].roll(-1, 1), torch.full((2, 3), -100)], dim=1)
    batch["shift_labels"] = wide[:, :10]  # the right shape, rows 13 apart: not viewable
    assert not batch["shift_labels"].is_contiguous()
    with pytest.raises(RuntimeError, match="view size is not compatible") as want:
        stock(**batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="view size is not compatible") as got:
            model(**batch)
    assert type(got.value) is type(want.value)
    # a viewable (contiguous) copy is fused and matches stock
    batch["shift_labels"] = batch["shift_labels"].contiguous()
    _assert_same(_run(model, batch), _run(stock, batch))


# -- positions of the deferred logits ----------------------------------------------------------


def _git_lora(dropout):
    peft = pytest.importorskip("peft")
    config = tiny_config("git")  # a 32-pixel image: 5 image positions before the text
    config.vocab_size = 300
    torch.manual_seed(0)
    base = transformers.GitForCausalLM(config).to(torch.float64).train()
    lora = peft.LoraConfig(r=4, target_modules="output|.*query", lora_dropout=dropout,
                           init_lora_weights=False)
    torch.manual_seed(3)
    model = peft.get_peft_model(base, lora)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 10), generator=g)
    labels = ids.clone()
    labels[1, 7:] = -100
    pixels = torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64)
    return model, {"input_ids": ids, "labels": labels, "pixel_values": pixels}


def test_git_positions_of_a_lora_dropout_head_take_real_logits_as_stock():
    # GIT selects its text positions (`logits[:, n:-1, :]`) before the loss. The deferred
    # selection ran the fused loss over the selected hidden rows only, so the LoRA dropout
    # mask was drawn over another shape than stock's (every position): float32 loss 5.87 vs
    # stock 5.74, the head's LoRA gradient 70 % off.
    model, batch = _git_lora(0.2)
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    want = _run(stock, batch)
    got, caught = _quiet_run(model, batch)
    _assert_same(got, want)
    assert not isinstance(got[0].logits, NotMaterializedLogits)
    assert any("selects positions of the logits of a head that draws dropout" in m
               for m in caught), caught


def test_git_positions_of_a_lora_head_without_dropout_stay_fused(spy):
    model, batch = _git_lora(0.0)
    stock = copy.deepcopy(model)
    apply_fused_ce(model, backend="torch")
    want = _run(stock, batch)
    spy.calls.clear()
    got, _ = _quiet_run(model, batch)
    _assert_same(got, want)
    assert isinstance(got[0].logits, NotMaterializedLogits) and len(spy.calls) == 1


# -- apply time ------------------------------------------------------------------------------


def _roberta_with_plain_lm_head():
    config = tiny_config("roberta")
    config.vocab_size, config.is_decoder = 97, True
    torch.manual_seed(0)
    model = transformers.RobertaForCausalLM(config).train()
    model.lm_head = torch.nn.Linear(config.hidden_size, 97)
    return model


def test_apply_to_a_model_whose_get_output_embeddings_raises_is_a_clear_refusal():
    # RobertaForCausalLM.get_output_embeddings() reads lm_head.decoder: with lm_head replaced,
    # apply_fused_ce raised that AttributeError (stock trains the model).
    from fused_ce_patch import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"get_output_embeddings\(\) raises "
                                                    r"AttributeError"):
        apply_fused_ce(_roberta_with_plain_lm_head(), backend="torch")


def test_trainer_flag_trains_stock_a_model_whose_get_output_embeddings_raises(tmp_path):
    # The flag's check called get_output_embeddings() unguarded: Trainer(...) raised the
    # AttributeError; now it warns and trains the model unpatched, as for any refusal.
    from transformers import Trainer

    from fused_ce_patch import FusedCETrainingArguments, is_fused_ce_applied

    model = _roberta_with_plain_lm_head()
    data = [{"input_ids": torch.arange(4, 16), "labels": torch.arange(4, 16)}] * 4
    args = FusedCETrainingArguments(output_dir=str(tmp_path), use_fused_ce=True,
                                    per_device_train_batch_size=2, max_steps=1, report_to=[],
                                    use_cpu=True, save_strategy="no")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    assert not is_fused_ce_applied(model)
    assert trainer.state.global_step == 1


def test_hooked_projection_inside_a_head_module_is_named_by_its_path():
    # The refusal named "lm_head (Linear)" for RoBERTa's lm_head.decoder.
    from fused_ce_patch import UnsupportedModelError

    config = tiny_config("roberta")
    config.vocab_size, config.is_decoder = 97, True
    model = transformers.RobertaForCausalLM(config).train()
    model.lm_head.decoder.register_forward_hook(lambda mod, args, out: out)
    with pytest.raises(UnsupportedModelError, match=r"^lm_head\.decoder \(Linear\) has forward "
                                                    r"hooks"):
        apply_fused_ce(model, backend="torch")

"""Shared helpers for the Hugging Face integration tests (fixtures live in conftest.py).

Every architecture gets a tiny random config (CPU, float32, vocab 1003 — prime, so no chunk
divides it). A test compares a patched model with an unpatched copy holding identical weights
whose loss is transformers' own ``ForCausalLMLoss`` (set on the instance, so a class patch's
loss routing cannot reach the reference), after a spy has shown which path
each model took.

Tolerances (stated once): loss relative error 1e-5, gradients and weights 1e-4, as the
relative error of the whole tensor ||a - b|| / ||b||.
"""

from __future__ import annotations

import copy

import torch

from fused_ce_patch.hf import loss_mapping
from fused_ce_patch.hf.proof import proving
from fused_ce_patch.numerics import relative_error

VOCAB = 1003
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3_text")
GEMMA2_SOFTCAP = 30.0


rel_err = relative_error  # ``||a - b|| / ||b||`` in float64: fused_ce_patch.numerics


def assert_close_rel(a, b, rtol, what=""):
    err = rel_err(a, b)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"


def tiny_config(arch: str, **overrides):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True)
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=8, tie_word_embeddings=False)
    elif arch == "gemma2":
        cfg = tf.Gemma2Config(**common, head_dim=8, sliding_window=8,
                              final_logit_softcapping=GEMMA2_SOFTCAP, query_pre_attn_scalar=8)
    elif arch == "gemma3_text":
        cfg = tf.Gemma3TextConfig(**common, head_dim=8, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"],
                                  query_pre_attn_scalar=8)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def build_model(arch: str, seed: int = 0, **overrides):
    """A tiny random causal LM of ``arch`` in train mode (float32, CPU)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    if arch == "gemma2":
        # Push raw logits far beyond the softcap (callers assert |z| > 2c as a precondition).
        with torch.no_grad():
            model.model.norm.weight.fill_(300.0)
    return model.train()


def reference_copy(model):
    """An unpatched deep copy whose loss is transformers' own ForCausalLMLoss."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if hasattr(m, "loss_type") and hasattr(type(m), "loss_function"):
            m.loss_function = loss_mapping.original_causal_lm_loss()
    return ref


def batch(batch_size=2, seq=16, seed=1, pad_row=True):
    """``input_ids``, ``attention_mask``, ``labels`` with the last row right-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    if pad_row:
        mask[-1, seq - 5:] = 0
        labels[-1, seq - 5:] = -100
        labels[0, :3] = -100  # a masked prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def short_batch(vocab: int):
    """2 x 10 token ids from ``[4, vocab)`` (seeded), the first row's first 3 labels ignored."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def shifted(labels: torch.Tensor) -> torch.Tensor:
    pad = labels.new_full((labels.shape[0], 1), -100)
    return torch.cat([labels[:, 1:], pad], dim=1)


def named_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_grads_close(patched, ref, rtol=GRAD_RTOL):
    got, want = named_grads(patched), named_grads(ref)
    assert got.keys() == want.keys()
    n_nonzero = 0
    for name in want:
        g, w = got[name], want[name]
        if w is None:
            assert g is None or not g.any(), name
            continue
        assert g is not None, f"{name}: no gradient in the patched model"
        assert_close_rel(g, w, rtol, name)
        n_nonzero += int(w.any())
    assert n_nonzero > 0


def step(model, batch, **kw):
    """One training step: ``(outputs, detached loss, {name: gradient})`` of every parameter
    that got a gradient (gradients cleared first)."""
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kw)
    out.loss.backward()
    return out, out.loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()
                                    if p.grad is not None}


def assert_step_close(got, want, loss_rtol, grad_rtol):
    """Two :func:`step` results agree: the loss within ``loss_rtol`` and each gradient's
    error norm within ``grad_rtol`` of its norm (floored at 1e-3 of the largest gradient norm,
    as the proof: a gradient zero in exact arithmetic is rounding noise)."""
    (_, loss, grads), (_, want_loss, want_grads) = got, want
    torch.testing.assert_close(loss, want_loss, rtol=loss_rtol, atol=0)
    assert grads.keys() == want_grads.keys()
    floor = 1e-3 * max(g.norm() for g in want_grads.values())
    for k, w in want_grads.items():
        assert (grads[k] - w).norm() <= grad_rtol * max(w.norm(), floor), k


class Spy:
    """Records every call of the fused loss made by the patched forward."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def __call__(self, hidden, weight, labels, **kwargs):
        if proving():  # the proof's tiny copy (hf/proof.py), not the model under test
            return self.fn(hidden, weight, labels, **kwargs)
        self.calls.append({
            "hidden": hidden, "weight": weight, "labels": labels, **kwargs,
            "autocast": torch.is_autocast_enabled(hidden.device.type),
            "autocast_dtype": torch.get_autocast_dtype(hidden.device.type),
        })
        return self.fn(hidden, weight, labels, **kwargs)

    @property
    def count(self):
        return len(self.calls)

    def reset(self):
        self.calls.clear()


class LogitsLossSpy:
    """Counts calls of the chunked logits loss's autograd function."""

    def __init__(self, fn_cls):
        self.count = 0
        spy = self

        class Counting(fn_cls):
            @classmethod
            def apply(cls, *args):
                spy.count += not proving()
                return fn_cls.apply(*args)

        self.cls = Counting


def compare_with_stock(model, ref, kw, fused, spy):
    """Run the unpatched ``ref`` then ``model`` on ``kw``; check which path ``model`` took (the
    fused kernel once and the sentinel as logits, or neither), then loss and every gradient."""
    from fused_ce_patch.hf.sentinel import NotMaterializedLogits

    want = ref(**kw)
    assert spy.count == 0
    got = model(**kw)
    assert spy.count == (1 if fused else 0)
    assert isinstance(got.logits, NotMaterializedLogits) is fused
    assert_close_rel(got.loss, want.loss, LOSS_RTOL, "loss")
    got.loss.backward()
    want.loss.backward()
    assert_grads_close(model, ref)
    return got, want


class CountingParametrization(torch.nn.Module):
    """A ``torch.nn.utils.parametrize`` parametrization that returns its input and counts its
    evaluations in ``n`` (stock evaluates a head's parametrization once per call)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def forward(self, x):
        self.n += 1
        return x


class DropoutParametrization(torch.nn.Module):
    """A parametrization that draws dropout at each evaluation (a random one: a second
    evaluation gives another tensor, so another loss)."""

    def __init__(self, p: float = 0.3):
        super().__init__()
        self.p = p

    def forward(self, x):
        return torch.nn.functional.dropout(x, self.p, training=True)

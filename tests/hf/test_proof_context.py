"""The proof in the caller's context (hf/clean_context.py): identical inside and outside.

``apply_fused_ce`` may be called inside ``inference_mode``, ``no_grad``, autocast, a
TorchFunctionMode or dispatch mode, with deterministic algorithms on: the proof sets all of it
aside, a refusal seen there is not remembered, and the caller's random streams and
transformers' ``warning_once`` messages are as they were.
"""

from __future__ import annotations

import contextlib
import logging
import random

import numpy as np
import pytest
import torch
import transformers
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fused_ce_patch import UnsupportedModelError, apply_fused_ce
from fused_ce_patch.hf import proof, tiny
from fused_ce_patch.hf.clean_context import caller_context
from fused_ce_patch.hf.sentinel import NotMaterializedLogits


pytestmark = pytest.mark.usefixtures("fresh_proofs")  # tests/hf/conftest.py


def _model(model_type):
    torch.manual_seed(0)
    config = tiny.tiny_config(model_type)
    cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    return cls(config).train(), tiny._batches(config, torch)["padded"]


class _RoundMatmulsToBf16(TorchFunctionMode):
    """A user's numerics-emulation mode: every F.linear output rounded through bfloat16."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear:
            self.calls += 1
            out = out.to(torch.bfloat16).to(out.dtype)
        return out


class _CountingDispatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


CONTEXTS = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "cpu_bf16_autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "function_mode": _RoundMatmulsToBf16,
    "dispatch_mode": _CountingDispatch,
    "deterministic": _deterministic,
    "matmul_precision_medium": lambda: _precision("medium"),
}


@contextlib.contextmanager
def _precision(value):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
@pytest.mark.parametrize("context", sorted(CONTEXTS))
def test_apply_inside_a_context_is_as_outside(context, model_type, spy):
    """Inside each context the proof passes as it does outside (Mixtral under CPU bf16
    autocast was refused with a false difference, every model under inference_mode), sees
    none of the caller's modes, and the patched model then gives stock's loss outside."""
    model, batch = _model(model_type)
    stock = model(**batch).loss.detach()
    ctx = CONTEXTS[context]()
    with ctx:
        assert caller_context(), context  # the context is one the proof sets aside
        apply_fused_ce(model, backend="torch")
    if hasattr(ctx, "calls"):
        assert ctx.calls == 0, "the proof ran under the caller's mode"
    assert caller_context() == []  # all put back
    spy.calls.clear()
    out = model(**batch)
    assert isinstance(out.logits, NotMaterializedLogits) and spy.count == 1
    torch.testing.assert_close(out.loss, stock, rtol=1e-5, atol=0)


def test_cuda_autocast_is_set_aside(monkeypatch):
    with torch.autocast("cuda", dtype=torch.float16):
        enabled = torch.is_autocast_enabled("cuda")
    if not enabled:
        pytest.skip("this torch build cannot enable CUDA autocast (no CUDA device)")
    seen = []
    real = proof._run_stock
    monkeypatch.setattr(proof, "_run_stock", lambda *a, **k: seen.append(
        torch.is_autocast_enabled("cuda")) or real(*a, **k))
    model, _ = _model("llama")
    with torch.autocast("cuda", dtype=torch.float16):
        apply_fused_ce(model, backend="torch")
        assert torch.is_autocast_enabled("cuda")
    assert seen == [False]


def test_the_proof_runs_with_none_of_the_callers_settings(monkeypatch):
    seen = []
    real = proof._run_stock

    def spy_stock(*args, **kwargs):
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                     torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"),
                     torch.are_deterministic_algorithms_enabled(),
                     [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()],
                     torch._C._len_torch_dispatch_stack(), torch.get_float32_matmul_precision(),
                     torch.empty(1).device.type))
        return real(*args, **kwargs)

    monkeypatch.setattr(proof, "_run_stock", spy_stock)
    model, _ = _model("llama")
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), \
            _deterministic(), _RoundMatmulsToBf16(), torch.device("meta"):
        apply_fused_ce(model, backend="torch")
        assert torch.is_inference_mode_enabled() and torch.is_autocast_enabled("cpu")
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.empty(1).device.type == "meta"
    # the only function mode inside is the proof's own torch.device("cpu")
    assert seen == [(True, False, False, False, False, ["DeviceContext"], 0, "highest", "cpu")]


def test_a_refusal_inside_a_context_is_not_remembered(monkeypatch):
    """A proof that fails while the caller has a context set is not kept: a later call
    outside proves again (and passes)."""
    real = proof.prove
    calls = []

    def flaky(*args, **kwargs):
        calls.append(caller_context())
        if len(calls) == 1:
            return {"status": "unbuildable", "reason": "stock forward: RuntimeError: injected"}
        return real(*args, **kwargs)

    monkeypatch.setattr(proof, "prove", flaky)
    model, _ = _model("llama")
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="injected"):
        apply_fused_ce(model, backend="torch")
    apply_fused_ce(model, backend="torch")
    assert calls == [["no_grad"], []]


def test_a_refusal_outside_any_context_is_remembered(monkeypatch):
    calls = []
    monkeypatch.setattr(proof, "prove", lambda *a, **k: calls.append(1) or {
        "status": "unbuildable", "reason": "stock forward: RuntimeError: injected"})
    model, _ = _model("llama")
    for _ in range(2):
        with pytest.raises(UnsupportedModelError, match="injected"):
            apply_fused_ce(model, backend="torch")
    assert calls == [1]


def test_warning_once_messages_survive_the_proof():
    """GPT-2's ``loss_type=None`` warning (a ``warning_once``) prints for the user's model
    after the proof ran a tiny GPT-2 that raised it too."""
    from transformers.utils import logging as hf_logging

    model, batch = _model("gpt2")
    hf_logging.warning_once.cache_clear()  # earlier tests in this process may have printed it
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    target = logging.getLogger("transformers.modeling_utils")
    target.addHandler(handler)
    try:
        apply_fused_ce(model, backend="torch")  # reads the user's model's loss_function too
        assert logging.Logger.warning_once is hf_logging.warning_once  # put back
        model.loss_function  # the user's own use
    finally:
        target.removeHandler(handler)
    # once, for the user's model (the tiny model's, at verbosity "error", left no cache entry)
    assert len([r for r in records if "loss_type=None" in r.getMessage()]) == 1


def test_random_streams_unchanged():
    model, _ = _model("mixtral")
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    want = torch.get_rng_state(), random.getstate(), np.random.get_state()
    apply_fused_ce(model, backend="torch")
    got = torch.get_rng_state(), random.getstate(), np.random.get_state()
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(got[2], want[2]))

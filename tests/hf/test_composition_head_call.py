"""Composition at the head: code that runs in ``lm_head``'s call besides ``forward``.

The fused loss reads the head's weight instead of calling the head, so anything the call would
run — backward hooks, torch's process-wide module hooks, accelerate hooks, an overridden
``__call__``, a process-wide replacement of ``nn.Linear.forward`` / ``F.linear`` /
``torch.tanh`` — must make ``apply_fused_ce`` refuse (when present then) or the call take the
stock computation (when added later), and a parametrized weight must be evaluated once per
call, as stock's call does. Each hook changes the numbers, so bypassing it would fail the
comparison with the unpatched twin (design.md §5, "the live model is the reference").
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from fused_ce_patch import apply_fused_ce
from fused_ce_patch.errors import UnsupportedModelError

from hf_helpers import batch, build_model, compare_with_stock, reference_copy


def _halve_input_grad(module, grad_input, grad_output):
    return (grad_input[0] * 0.5,)


def _halve_output_grad(module, grad_output):
    return (grad_output[0] * 0.5,)


BACKWARD_HOOKS = {
    "full": lambda head: head.register_full_backward_hook(_halve_input_grad),
    "pre": lambda head: head.register_full_backward_pre_hook(_halve_output_grad),
}


@pytest.mark.parametrize("kind", list(BACKWARD_HOOKS))
def test_backward_hook_added_after_the_patch_runs_as_stock(kind, spy):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, ref):
        BACKWARD_HOOKS[kind](m.lm_head)
    with pytest.warns(RuntimeWarning, match="backward hooks"):
        compare_with_stock(model, ref, batch(), False, spy)


@pytest.mark.parametrize("kind", list(BACKWARD_HOOKS))
def test_backward_hook_at_apply_time_is_refused(kind):
    model = build_model("llama")
    BACKWARD_HOOKS[kind](model.lm_head)
    with pytest.raises(UnsupportedModelError, match="backward hooks"):
        apply_fused_ce(model, backend="torch")


@pytest.fixture
def global_hook():
    """Registers one of torch's process-wide module hooks that acts on the given heads only;
    removed after the test."""
    handles = []

    def register(kind, heads):
        if kind == "forward":
            handles.append(torch_module.register_module_forward_hook(
                lambda m, args, out: out * 2.0 if any(m is h for h in heads) else None))
        else:
            handles.append(torch_module.register_module_full_backward_hook(
                lambda m, gi, go: (gi[0] * 0.5,) if any(m is h for h in heads) else None))

    yield register
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_process_wide_module_hook_runs_as_stock(kind, spy, global_hook):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    global_hook(kind, [model.lm_head, ref.lm_head])
    with pytest.warns(RuntimeWarning, match="process-wide module"):
        compare_with_stock(model, ref, batch(), False, spy)


def test_process_wide_module_hook_at_apply_time_is_refused(global_hook):
    model = build_model("llama")
    global_hook("forward", [model.lm_head])
    with pytest.raises(UnsupportedModelError, match="process-wide module forward hooks"):
        apply_fused_ce(model, backend="torch")


def _tripling_hook():
    from accelerate.hooks import ModelHook

    class Triple(ModelHook):
        def post_forward(self, module, output):
            return output * 3.0

    return Triple()


def test_accelerate_hook_that_changes_the_output_runs_as_stock(spy):
    from accelerate.hooks import add_hook_to_module

    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, ref):
        add_hook_to_module(m.lm_head, _tripling_hook())
    with pytest.warns(RuntimeWarning, match="accelerate Triple hook"):
        compare_with_stock(model, ref, batch(), False, spy)
    other = build_model("llama")
    add_hook_to_module(other.lm_head, _tripling_hook())
    with pytest.raises(UnsupportedModelError, match="accelerate Triple hook"):
        apply_fused_ce(other, backend="torch")


def test_accelerate_device_placement_hook_keeps_the_fused_path(spy):
    """accelerate's device-map hook (AlignDevicesHook; with ``append`` a SequentialHook of
    them) only moves tensors: the fused path stays, with stock's numbers."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = build_model("llama")
    ref = reference_copy(model)
    for m in (model, ref):
        add_hook_to_module(m.lm_head, AlignDevicesHook(execution_device="cpu",
                                                       io_same_device=True))  # fmt: skip
        add_hook_to_module(m.lm_head, AlignDevicesHook(execution_device="cpu"), append=True)
    apply_fused_ce(model, backend="torch")
    compare_with_stock(model, ref, batch(), True, spy)


def test_head_class_with_its_own_call_is_refused():
    class Scaled(nn.Linear):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs) * 2.0

    model = build_model("llama")
    head = model.lm_head
    model.lm_head = Scaled(head.in_features, head.out_features, bias=False)
    with pytest.raises(UnsupportedModelError, match="Scaled"):
        apply_fused_ce(model, backend="torch")


@pytest.mark.parametrize("what", ["F.linear", "Linear.forward"])
def test_linear_replaced_process_wide_runs_as_stock(what, spy, monkeypatch):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    if what == "F.linear":
        real = F.linear
        monkeypatch.setattr(F, "linear", lambda x, w, b=None: 2.0 * real(x, w, b))
    else:
        real = nn.Linear.forward
        monkeypatch.setattr(nn.Linear, "forward", lambda self, x: 2.0 * real(self, x))
    with pytest.warns(RuntimeWarning, match="replaced process-wide"):
        compare_with_stock(model, ref, batch(), False, spy)


def test_tanh_replaced_under_a_softcap_runs_as_stock(spy, monkeypatch):
    model = build_model("gemma2", final_logit_softcapping=2.0)
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    real = torch.tanh
    monkeypatch.setattr(torch, "tanh", lambda x: real(0.5 * x))
    with pytest.warns(RuntimeWarning, match="torch.tanh"):
        compare_with_stock(model, ref, batch(), False, spy)


def test_spectral_norm_head_is_evaluated_once_per_call(spy):
    """spectral_norm's power iteration updates its vectors on every read of the weight in
    training: the fused path reads it once, as the stock call does, so the vectors, the loss
    and the gradients stay the stock model's step after step."""
    model = build_model("llama")
    nn.utils.parametrizations.spectral_norm(model.lm_head)
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        spy.calls.clear()
        compare_with_stock(model, ref, batch(), True, spy)
    ours = model.lm_head.parametrizations.weight[0]
    theirs = ref.lm_head.parametrizations.weight[0]
    assert torch.equal(ours._u, theirs._u) and torch.equal(ours._v, theirs._v)


def test_get_output_embeddings_replaced_on_the_instance_runs_as_stock(spy):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, ref):
        m.get_output_embeddings = lambda: None
    with pytest.warns(RuntimeWarning, match="not get_output_embeddings"):
        compare_with_stock(model, ref, batch(), False, spy)

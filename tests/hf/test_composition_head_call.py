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


def test_module_call_replaced_process_wide_runs_as_stock(spy, monkeypatch):
    """``nn.Module.__call__`` itself replaced (a wrapper that doubles the heads' outputs):
    compared with what torch defined at import, not with itself."""
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    heads = (model.lm_head, ref.lm_head)
    real = nn.Module.__call__

    def call(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        return out * 2.0 if any(self is h for h in heads) else out

    monkeypatch.setattr(nn.Module, "__call__", call)
    with pytest.warns(RuntimeWarning, match="Linear"):
        compare_with_stock(model, ref, batch(), False, spy)


def test_foreign_compiled_call_and_rebound_linear_module_f_run_as_stock(spy, monkeypatch):
    """Two other ways the head's call computes something else: an instance
    ``_compiled_call_impl`` that is not ``module.compile()``'s, and the ``F`` that
    ``nn.Linear.forward`` calls rebound in its module."""
    import types

    from torch.nn.modules import linear as linear_module

    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    for m in (model, ref):
        head = m.lm_head
        m.lm_head._compiled_call_impl = lambda *a, _h=head, **k: 2.0 * _h._call_impl(*a, **k)
    with pytest.warns(RuntimeWarning, match="Linear"):
        compare_with_stock(model, ref, batch(), False, spy)
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    doubled = types.SimpleNamespace(linear=lambda x, w, b=None: 2.0 * F.linear(x, w, b))
    monkeypatch.setattr(linear_module, "F", doubled)
    with pytest.warns(RuntimeWarning, match="torch.nn.modules.linear.F"):
        compare_with_stock(model, ref, batch(), False, spy)


def test_module_compile_of_the_head_keeps_the_fused_path(spy):
    """``lm_head.compile()`` compiles the head's own call: not a replacement."""
    model = build_model("llama")
    ref = reference_copy(model)
    model.lm_head.compile(backend="eager")
    apply_fused_ce(model, backend="torch")
    compare_with_stock(model, ref, batch(), True, spy)


def test_module_trackers_keep_the_fused_path(spy):
    """torch's module trackers (FlopCounterMode, MemTracker, CommDebugMode) register
    process-wide hooks that only record which module runs: a profiled step keeps the fused
    path, so it measures what the others run."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    with FlopCounterMode(display=False):
        compare_with_stock(model, ref, batch(), True, spy)


def test_parametrization_storing_another_shape_keeps_the_fused_path(spy):
    """A parametrization whose stored tensor is the weight transposed: the checks before the
    loss do not read it as the weight (vocab_size against its rows); the loss evaluates it."""
    import torch.nn.utils.parametrize as parametrize

    class Transposed(nn.Module):
        def forward(self, stored):
            return stored.t()

        def right_inverse(self, weight):
            return weight.t()

    model = build_model("llama")
    parametrize.register_parametrization(model.lm_head, "weight", Transposed())
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    compare_with_stock(model, ref, batch(), True, spy)

"""fused_ce_patch combined with Liger-Kernel's other kernels (CPU, Triton interpreter).

The recipe (docs/usage.md "With Liger-Kernel's other kernels"): Liger's non-loss kernels with
``fused_linear_cross_entropy=False``, then (or before) ``apply_fused_ce(model)``. Liger's loss
kernel replaces the causal LM's forward, which is what fused_ce_patch patches, so with it on
``apply_fused_ce`` must refuse with a short error naming Liger and the fix — never compute the
loss twice or silently let one of the two fused losses win.

What runs here: liger-kernel 0.8.5's RoPE kernel runs on CPU tensors under
``TRITON_INTERPRET=1``; its RMSNorm, SwiGLU and GeGLU kernels do not (the interpreter passes
Python float arguments as floats, on which the kernels call ``.to``; GeGLU's ``tanh`` has no
interpreter implementation). So the numeric check here runs Liger's RoPE with our patch, the
structural checks run with every non-loss Liger kernel patched in, and
``tests/gpu/test_liger_gpu.py`` runs the numeric check with all of them on a GPU.

Liger patches module globals and classes process-wide, even when given ``model=``
(``modeling_llama.apply_rotary_pos_emb``, ``modeling_llama.LlamaRMSNorm``, ...): the
``_restore_transformers`` fixture puts every one of them back after each test, and
``_nothing_left_behind`` checks, after the last test of this file (in the same process, also
under ``pytest -n``), that nothing was.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines (GPU: tests/gpu/test_liger_gpu.py)",
                allow_module_level=True)
if importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("liger-kernel (and triton) not installed: pip install liger-kernel==0.8.5",
                allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_behind():
    """After this file: no Liger function left in transformers' modules, ``TRITON_INTERPRET``
    unset. A leaked ``apply_rotary_pos_emb`` would make every later Llama / Gemma-3 test in this
    process run Liger's RoPE in the Triton interpreter (correct, but minutes slower)."""
    yield
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama

    for module in (modeling_llama, modeling_gemma3):
        leaked = {name: getattr(value, "__module__", "") for name, value in vars(module).items()
                  if getattr(value, "__module__", "").startswith("liger_kernel")}
        assert not leaked, f"{module.__name__} still holds Liger's {leaked}"
    assert os.environ.get("TRITON_INTERPRET") in (None, "0", ""), "TRITON_INTERPRET left set"


def _import_liger():
    # A @triton.jit function becomes an interpreted one when its module is imported with
    # TRITON_INTERPRET=1 (tests/backends/interpreted.py does the same for our kernels).
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("liger_kernel.ops.rope")
        # Trainer's Liger path reads liger_kernel.transformers.monkey_patch as an attribute
        importlib.import_module("liger_kernel.transformers.monkey_patch")
        return importlib.import_module("liger_kernel.transformers")
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


lk = _import_liger()

from transformers import Trainer  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from fused_ce_patch import (  # noqa: E402
    FusedCETrainingArguments,
    UnsupportedModelError,
    apply_fused_ce,
    apply_fused_ce_to_llama,
    revert_fused_ce,
)
from fused_ce_patch.hf.patch import is_fused_ce_applied  # noqa: E402
from module_state import kept  # noqa: E402
from hf_helpers import (  # noqa: E402
    LOSS_RTOL,
    assert_close_rel,
    assert_grads_close,
    batch,
    build_model,
    reference_copy,
)

MODULES = {"llama": modeling_llama, "gemma3_text": modeling_gemma3}
CLASSES = {"llama": modeling_llama.LlamaForCausalLM,
           "gemma3_text": modeling_gemma3.Gemma3ForCausalLM}
#: Liger's flag for the MLP kernel of each architecture.
MLP_FLAG = {"llama": "swiglu", "gemma3_text": "geglu"}


def apply_liger(arch, *, model=None, rope=True, rms_norm=False, mlp=False, flce=False):
    fn = {"llama": lk.apply_liger_kernel_to_llama,
          "gemma3_text": lk.apply_liger_kernel_to_gemma3_text}[arch]
    fn(rope=rope, rms_norm=rms_norm, cross_entropy=False, fused_linear_cross_entropy=flce,
       model=model, **{MLP_FLAG[arch]: mlp})


@pytest.fixture(autouse=True)
def _restore_transformers():
    """Undo Liger's process-wide patches; run each test under the Triton interpreter.

    Deliberately not built on ``monkeypatch``: this fixture must be torn down after the
    test's own ``monkeypatch`` (which would otherwise re-install, on undo, a Liger function it
    had wrapped), and an autouse fixture with no dependency is set up first, torn down last.
    """
    env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    with kept(MODULES.values(), CLASSES.values()):
        yield
    if env is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = env


class _Counter:
    def __init__(self):
        self.count = 0


def spy_liger_rope(arch) -> _Counter:
    """Counts calls of Liger's RoPE where the attention looks it up (the module global).

    Set directly, not with ``monkeypatch``: ``_restore_transformers`` puts the module back as
    it was before Liger; a ``monkeypatch`` undo, which a conftest fixture may schedule after
    that, would re-install Liger's function."""
    module = MODULES[arch]
    liger_rope = module.apply_rotary_pos_emb
    assert liger_rope.__module__.startswith("liger_kernel"), liger_rope.__module__
    counter = _Counter()

    @functools.wraps(liger_rope)
    def counting(*args, **kwargs):
        counter.count += 1
        return liger_rope(*args, **kwargs)

    module.apply_rotary_pos_emb = counting
    return counter


def _runs_liger(module) -> bool:
    """Liger swaps a built module's forward (and name), keeping its transformers class."""
    forward = getattr(module.forward, "__func__", module.forward)
    return forward.__module__.startswith("liger_kernel")


def loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out


# -- the recipe: Liger's non-loss kernels + our patch -----------------------------------------


@pytest.mark.parametrize("order", ["liger_first", "fused_first"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_liger_rope_with_fused_ce_matches_liger_alone(arch, order, spy, monkeypatch):
    model = build_model(arch)
    ref = reference_copy(model)  # same weights, transformers' own loss, no fused_ce_patch
    if order == "fused_first":
        apply_fused_ce(model)
    apply_liger(arch, model=model)
    apply_liger(arch, model=ref)
    if order == "liger_first":
        apply_fused_ce(model)
    rope = spy_liger_rope(arch)
    inputs = batch()

    want = loss_and_grads(ref, inputs)
    ref_rope_calls = rope.count
    assert spy.count == 0 and ref_rope_calls == model.config.num_hidden_layers
    got = loss_and_grads(model, inputs)
    assert spy.count == 1, "the fused loss did not run exactly once"
    assert rope.count == 2 * ref_rope_calls, "Liger's RoPE did not run in the patched model"
    assert_close_rel(got.loss.detach(), want.loss.detach(), LOSS_RTOL, "loss")
    assert_grads_close(model, ref)  # every parameter, lm_head / tied embedding included


@pytest.mark.parametrize("order", ["liger_first", "fused_first"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_all_non_loss_kernels_leave_the_forward_to_patch(arch, order):
    """With RMSNorm, RoPE and SwiGLU/GeGLU all on, Liger touches modules, not the causal LM's
    forward: the patch goes on (in either order) and reverts to exactly what was there."""
    model = build_model(arch)
    stock = CLASSES[arch].__dict__["forward"]
    if order == "fused_first":
        apply_fused_ce(model)
    apply_liger(arch, model=model, rms_norm=True, mlp=True)
    if order == "liger_first":
        apply_fused_ce(model)
    assert _runs_liger(model.model.norm) and _runs_liger(model.model.layers[0].mlp)
    assert CLASSES[arch].__dict__["forward"] is stock
    assert is_fused_ce_applied(model)
    apply_fused_ce(model)  # again: a no-op, Liger did not replace our forward
    revert_fused_ce(model)
    assert not is_fused_ce_applied(model) and "forward" not in model.__dict__


def test_trainer_flag_with_liger_kernel_config(tmp_path, spy, monkeypatch):
    """Trainer's own Liger switch with its loss kernel off, beside use_fused_ce."""
    from test_trainer import make_dataset

    calls = {"liger_rope": 0}
    liger_rope = importlib.import_module("liger_kernel.transformers.rope").liger_rotary_pos_emb

    def counting(*args, **kwargs):
        calls["liger_rope"] += 1
        return liger_rope(*args, **kwargs)

    # Trainer applies Liger inside train(); count the RoPE it installs.
    monkeypatch.setattr(lk.monkey_patch, "liger_rotary_pos_emb", counting)
    model = build_model("llama")
    args = FusedCETrainingArguments(
        output_dir=str(tmp_path), use_fused_ce=True, use_liger_kernel=True,
        liger_kernel_config={"rope": True, "rms_norm": False, "swiglu": False,
                             "fused_linear_cross_entropy": False},
        per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=make_dataset())
    assert is_fused_ce_applied(model)
    trainer.train()
    assert spy.count == 1 and calls["liger_rope"] > 0


# -- Liger's own fused loss on: a short refusal, never two losses -----------------------------


def _assert_liger_refusal(exc_info):
    msg = str(exc_info.value)
    assert "Liger" in msg and "fused_linear_cross_entropy=False" in msg, msg
    assert "supported model types" not in msg and len(msg) < 400, msg


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_liger_flce_on_the_class_is_refused(arch):
    apply_liger(arch, flce=True)  # model=None: Liger replaces XForCausalLM.forward
    model = build_model(arch)
    with pytest.raises(UnsupportedModelError) as info:
        apply_fused_ce(model)
    _assert_liger_refusal(info)
    assert "fresh process" in str(info.value)
    assert not is_fused_ce_applied(model) and "forward" not in model.__dict__
    if arch == "llama":
        with pytest.raises(UnsupportedModelError) as info:
            apply_fused_ce_to_llama()
        _assert_liger_refusal(info)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_liger_flce_on_the_instance_is_refused(arch):
    model = build_model(arch)
    apply_liger(arch, model=model, flce=True)
    liger_forward = model.__dict__["forward"]
    with pytest.raises(UnsupportedModelError) as info:
        apply_fused_ce(model)
    _assert_liger_refusal(info)
    assert not is_fused_ce_applied(model) and model.__dict__["forward"] is liger_forward


def test_liger_flce_after_fused_ce_is_caught_on_reapply():
    """Liger's instance FLCE put on after apply_fused_ce takes the forward over (Liger's loss
    alone runs then, once); applying again says so instead of a silent no-op."""
    model = build_model("llama")
    apply_fused_ce(model)
    apply_liger("llama", model=model, flce=True)
    with pytest.raises(UnsupportedModelError) as info:
        apply_fused_ce(model)
    _assert_liger_refusal(info)


def test_liger_class_flce_after_instance_patch_runs_as_the_live_class(spy):
    """Liger replaces the class forward after our instance patch: an unpatched instance would
    now run Liger's forward, so ours steps aside to it (one warning), never stacking two fused
    losses and never keeping a forward the class no longer has. (Liger's own kernel needs a
    GPU; the stand-in records the call and computes the stock loss.)"""
    model = build_model("llama")
    ref = reference_copy(model)
    inputs = batch()
    want = loss_and_grads(ref, inputs)
    stock = CLASSES["llama"].__dict__["forward"]
    apply_fused_ce(model)
    apply_liger("llama", rope=False, flce=True)
    liger_forward = CLASSES["llama"].__dict__["forward"]
    assert liger_forward.__module__.startswith("liger_kernel")
    called = []

    @functools.wraps(liger_forward)
    def counting(self, *args, **kwargs):
        called.append(1)
        return stock(self, *args, **kwargs)

    CLASSES["llama"].forward = counting  # restored by _restore_transformers
    with pytest.warns(RuntimeWarning, match="class's forward changed"):
        got = loss_and_grads(model, inputs)
    assert spy.count == 0 and called
    assert_close_rel(got.loss.detach(), want.loss.detach(), LOSS_RTOL, "loss")
    assert_grads_close(model, ref)

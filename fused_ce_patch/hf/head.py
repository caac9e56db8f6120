"""The lm_head as the fused loss sees it: ``(hidden, weight, bias)`` with every adapter included.

The fused loss never calls ``lm_head(hidden)``; it reads the weight. That is only correct when
the weight *is* what the head computes. This module resolves the head module returned by
``model.get_output_embeddings()`` on every call (FSDP, PEFT and accelerate replace modules after
patching) into operands of one linear map:

- plain ``nn.Linear``: ``(h, W, b)``;
- PEFT ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``): the active trainable copy,
  or the frozen original while adapters are disabled — the same module the wrapper's own
  forward would call;
- PEFT LoRA on the head (``lora.Linear``): ``h·Wᵀ + s·(drop(h)·Aᵀ)·Bᵀ`` folded exactly into one
  linear map by concatenation, ``[h | s·drop(h)·Aᵀ] · [W | B]ᵀ``, so the adapter receives its
  gradient through the fused kernel (one extra ``[V, H + r]`` weight copy per step, no logits);
- anything else (DoRA or other LoRA variants, other PEFT tuners, quantised or custom heads,
  heads whose call runs more than ``forward``: forward hooks of unknown purpose, backward
  hooks, torch's process-wide module hooks, accelerate hooks other than device placement, an
  overridden ``__call__``, a replaced ``nn.Linear.forward`` / ``F.linear``) raises
  :class:`~fused_ce_patch.errors.UnsupportedModelError` instead of silently training without
  the adapter.

Sharded heads (:func:`fused_head_loss`). Wrappers that shard parameters gather them in the
owning module's call and re-gather / reduce-scatter in backward hooks they attach to that
call's inputs and outputs: FSDP1 (``FullyShardedDataParallel`` around the head), FSDP2
(``fully_shard(lm_head)``, forward hooks of ``FSDPState``) and DeepSpeed ZeRO-3 (forward hooks
of ``DeepSpeedZeRoOffload``). For every such owner the fused loss runs *inside* the owner's own
``__call__``: its ``forward`` is bound, for that one call, to a function that computes the loss
from the now-gathered parameters and returns it, so the owner's hooks treat the scalar loss as
the module output (backward re-gathers, then reduce-scatters the gradient exactly as after
``lm_head(hidden)``). No copy of the full weight outlives the call. A weight that is still a
shard at loss time (DTensor, empty ZeRO-3 placeholder, FSDP1 flat shard) raises naming the mode.

Tensor-parallel heads (:func:`tp_head_layout`). transformers' ``tp_plan`` (``from_pretrained(...,
tp_plan="auto")``, 5.2x ``distributed/tensor_parallel.py``) makes ``lm_head`` a
``colwise_gather_output`` layer: its weight (and bias) becomes a ``DTensor`` split along the
vocabulary (``Shard(0)`` over the 1-D tensor-parallel mesh) and its ``forward`` is replaced on
the instance by one that all-gathers the ``[tokens, vocab]`` logits on every rank. That layout
is recognised (the replaced forward is transformers' own, wrapping ``nn.Linear.forward``, with
replicated input and output) and the loss is computed vocabulary-parallel from the local shard
(:func:`~fused_ce_patch.vocab_parallel.vocab_parallel_linear_cross_entropy`): gradients reach the
``DTensor`` parameters as ``Shard(0)`` shards and ``dH`` is all-reduced, as after the stock
head. Any other tensor-parallel layout of the head raises naming it.

Source: PEFT 0.21 ``tuners/lora/layer.py`` (``Linear.forward``) and ``utils/other.py``
(``ModulesToSaveWrapper``) for what each wrapper computes; the concatenation is this project's.
torch 2.13 ``distributed/fsdp/_fully_shard/_fsdp_state.py`` and
``fully_sharded_data_parallel.py``, DeepSpeed 0.19 ``runtime/zero/parameter_offload.py`` for
where each wrapper gathers.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from ..errors import UnsupportedModelError
from ..loss import fused_linear_cross_entropy
from ..token_stats import fused_linear_token_stats
from ..vocab_parallel import dtensor_vocab_shard, vocab_parallel_linear_cross_entropy
from .loss_mapping import defined_in

_ESCAPE = (
    "Train this model without the fused loss (apply_fused_ce(model, return_logits=True)), or "
    "keep lm_head a plain nn.Linear (PEFT: modules_to_save=['lm_head'] or plain LoRA)."
)


def _peft_classes():
    """PEFT wrapper classes, or None when PEFT was never imported (then no head is wrapped)."""
    if "peft" not in sys.modules:
        return None
    # Once PEFT's modules are loaded these are attribute reads of them, which is what the import
    # statements below do after their sys.modules lookup (each such statement costs about a
    # microsecond per call, and this runs three times per patched forward).
    found = (_loaded_attr("peft.tuners.tuners_utils", "BaseTunerLayer"),
             _loaded_attr("peft.utils.other", "AuxiliaryTrainingWrapper"),
             _loaded_attr("peft.utils.other", "ModulesToSaveWrapper"),
             _loaded_attr("peft.tuners.lora.layer", "Linear"))
    if None not in found:
        return found
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # older PEFT: ModulesToSaveWrapper was the only wrapper
        AuxiliaryTrainingWrapper = ModulesToSaveWrapper
    from peft.tuners.lora.layer import Linear as LoraLinear

    return BaseTunerLayer, AuxiliaryTrainingWrapper, ModulesToSaveWrapper, LoraLinear


def _loaded_attr(module_name: str, attr: str):
    """``module_name.attr`` when that module is loaded and has it, else None (then the caller
    imports it)."""
    return getattr(sys.modules.get(module_name), attr, None)


def _gatherer(hook) -> str | None:
    """Which parameter-sharding wrapper registered ``hook`` (None: unknown purpose)."""
    while True:  # look through functools.wraps / torch.compiler.disable / partial layers
        inner = getattr(hook, "__wrapped__", None) or getattr(hook, "func", None)
        if inner is None and getattr(hook, "__module__", "") == "deepspeed.utils.nvtx":
            # DeepSpeed's instrument_w_nvtx wraps without functools.wraps: the hook is the
            # function in the wrapper's closure.
            cells = [c.cell_contents for c in hook.__closure__ or ()]
            inner = next((c for c in cells if callable(c)), None)
        if inner is None or inner is hook:
            break
        hook = inner
    module = getattr(hook, "__module__", None) or ""  # a bound method reports its function's
    if module.startswith("torch.distributed.fsdp._fully_shard"):
        return "FSDP2 (fully_shard)"
    if module.startswith("deepspeed.runtime.zero"):
        return "DeepSpeed ZeRO-3"
    return None


def _check_no_hooks(module: nn.Module, name: str, owners: list | None = None):
    # Hooks (PEFT's mixed-batch adapter_names, user hooks) run only when the module is called;
    # reading its weight would silently skip them. Hooks of a wrapper that gathers the module's
    # parameters are honoured instead: with ``owners`` given, the module joins the list of
    # modules inside whose call the loss runs (see fused_head_loss).
    everywhere = _global_hooks()
    if everywhere:
        raise UnsupportedModelError(
            f"torch's process-wide module {everywhere} hooks are registered "
            f"(torch.nn.modules.module.register_module_*_hook); they would run in {name}'s "
            f"call, which the fused loss bypasses because it reads the weight. {_ESCAPE}"
        )
    if module._backward_pre_hooks or module._backward_hooks:
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}) has backward hooks, which would see the "
            f"gradient of its output that the fused loss never forms (it reads the weight "
            f"instead of calling the module). {_ESCAPE}"
        )
    if module._forward_pre_hooks or module._forward_hooks:
        hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        kinds = {_gatherer(h) for h in hooks}
        if owners is None or None in kinds:
            known = "" if owners is None or kinds == {None} else (
                f" besides those of {', '.join(sorted(k for k in kinds if k))}"
            )
            raise UnsupportedModelError(
                f"{name} ({type(module).__name__}) has forward hooks{known}, which the fused loss "
                f"would bypass because it reads the weight instead of calling the module. "
                f"{_ESCAPE}"
            )
        if not owners or owners[-1][1] is not module:
            owners.append((module, module))
    if "forward" in module.__dict__:
        if _device_placement_hook(module):  # accelerate's device map: moves, changes nothing
            return
        if tp_head_layout(module, name) is not None:  # transformers' tensor parallelism
            return
        hook = module.__dict__.get("_hf_hook")
        what = f"an accelerate {type(hook).__name__} hook" if hook is not None else \
            "a replaced forward on the instance"
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}) has {what}, which the fused loss would bypass. "
            f"{_ESCAPE}"
        )


def _global_hooks() -> str:
    """The kinds of torch's process-wide module hooks now registered ("" when none): they run in
    every module's call, the head's included."""
    m = _torch_module
    if not (m._global_forward_pre_hooks or m._global_forward_hooks
            or m._global_backward_pre_hooks or m._global_backward_hooks):
        return ""  # the usual case, without building the list below
    kinds = [("forward pre-", m._global_forward_pre_hooks), ("forward", m._global_forward_hooks),
             ("backward pre-", m._global_backward_pre_hooks),
             ("backward", m._global_backward_hooks)]  # fmt: skip
    return ", ".join(kind for kind, hooks in kinds
                     if any(not _tracker_hook(h) for h in hooks.values()))


#: Modules whose process-wide module hooks only record which module runs (torch's module
#: trackers, which FlopCounterMode, MemTracker and CommDebugMode use; their hooks return None):
#: the fused loss keeps its path under them, so a profiled step measures what the others run.
#: torch 2.13 ``utils/module_tracker.py``, ``distributed/_tools/mod_tracker.py``,
#: ``distributed/tensor/debug/_comm_mode.py``.
_TRACKER_MODULES = ("torch.utils.module_tracker", "torch.distributed._tools.mod_tracker",
                    "torch.distributed._tools.mem_tracker",
                    "torch.distributed.tensor.debug._comm_mode")


def _tracker_hook(hook) -> bool:
    return getattr(hook, "__module__", None) in _TRACKER_MODULES


#: accelerate hook classes that only place tensors on devices (device maps, CPU offload):
#: their ``pre_forward`` / ``post_forward`` move inputs, outputs and weights without changing a
#: value. Others (e.g. ``LayerwiseCastingHook``, which casts the weight) change what the head
#: computes. accelerate 1.x ``hooks.py``.
_PLACEMENT_HOOKS = ("ModelHook", "AlignDevicesHook", "CpuOffload", "UserCpuOffloadHook")


def _device_placement_hook(module: nn.Module) -> bool:
    """Whether ``module.forward`` is accelerate's ``add_hook_to_module`` wrapper around the
    module's own class forward with only device-placement hooks (:data:`_PLACEMENT_HOOKS`,
    exact classes, gradients on)."""
    hook = module.__dict__.get("_hf_hook")
    forward = module.__dict__.get("forward")
    inner = getattr(forward, "func", None)
    if hook is None or getattr(inner, "__module__", None) != "accelerate.hooks" or \
            getattr(inner, "__name__", None) != "new_forward":
        return False
    old = module.__dict__.get("_old_forward")
    if getattr(old, "__func__", None) is not type(module).forward or \
            getattr(old, "__self__", None) is not module:
        return False
    sequence = type(hook).__name__ == "SequentialHook" and \
        type(hook).__module__ == "accelerate.hooks"
    hooks = list(getattr(hook, "hooks", ())) if sequence else [hook]
    return all(type(h).__module__ == "accelerate.hooks"
               and type(h).__name__ in _PLACEMENT_HOOKS and not getattr(h, "no_grad", False)
               for h in hooks)  # fmt: skip


def tp_head_layout(module: nn.Module, name: str = "lm_head"):
    """The tensor-parallel layout transformers installed on ``module``, if any.

    transformers 5.2x ``TensorParallelLayer.install_forward`` replaces ``module.forward`` on
    the instance by a closure ``tp_forward`` over the style object, the mesh and the original
    forward. The supported layout is the vocabulary-parallel head: a
    ``ColwiseParallel`` style (``colwise_gather_output`` / ``colwise_rep``) with replicated
    input and output around a plain ``nn.Linear.forward``.

    Returns:
        None when ``module.forward`` is not transformers' tensor-parallel forward, else the
        style object (supported).

    Raises:
        UnsupportedModelError: transformers' tensor-parallel forward with another style or
            layout (names it), or around a forward that is not ``nn.Linear``'s.
    """
    forward = module.__dict__.get("forward")
    qualname = getattr(forward, "__qualname__", "")
    if not (getattr(forward, "__module__", "") or "").startswith("transformers.") or not \
            qualname.endswith("install_forward.<locals>.tp_forward"):
        return None
    cells = dict(zip(forward.__code__.co_freevars,
                     (c.cell_contents for c in forward.__closure__ or ())))
    style, inner = cells.get("self"), cells.get("original_forward")
    layout = (f"{type(style).__name__}(input_layouts={getattr(style, 'input_layouts', None)}, "
              f"output_layouts={getattr(style, 'output_layouts', None)})")
    from torch.distributed.tensor import Replicate

    supported = (
        type(style).__name__ == "ColwiseParallel"
        and getattr(style, "input_layouts", None) == Replicate()
        and getattr(style, "output_layouts", None) == Replicate()
        and not getattr(module, "_hf_quantized_needs_local_tp", False)
    )
    if not supported:
        raise UnsupportedModelError(
            f"{name} is a transformers tensor-parallel layer {layout}; the fused loss computes "
            f"a tensor-parallel head only as colwise_gather_output (vocabulary split over a "
            f"1-D mesh, replicated input and gathered output). {_ESCAPE}"
        )
    if getattr(inner, "__func__", None) is not nn.Linear.forward or \
            getattr(inner, "__self__", None) is not module:
        raise UnsupportedModelError(
            f"{name}'s tensor-parallel forward {layout} wraps {inner!r}, not nn.Linear.forward "
            f"of the head itself. {_ESCAPE}"
        )
    return style


def _fsdp1_class():
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    found = _loaded_attr("torch.distributed.fsdp", "FullyShardedDataParallel")
    if found is not None:  # what the import statement below reads, without its cost
        return found
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


#: transformers' float32-output heads: an ``nn.Linear`` without bias whose forward computes
#: ``F.linear(h.float(), W.to(h.dtype).float())`` with autocast off, ``h`` first cast to the
#: weight's dtype when ``cast_input_to_weight_dtype`` (on CUDA without grad, the same products
#: in one float32-output matmul). transformers 5.25 ``models/ergo/modeling_ergo.py``.
_FP32_OUTPUT_HEADS = (("transformers.models.ergo.modeling_ergo", "ErgoLinearWithFP32Output"),)


def fp32_output_head(module) -> bool:
    """Whether ``module`` is one of :data:`_FP32_OUTPUT_HEADS`, its class forward unchanged
    since its module defined it."""
    cls = type(module)
    if (cls.__module__, cls.__qualname__) not in _FP32_OUTPUT_HEADS or \
            not isinstance(module, nn.Linear) or getattr(module, "bias", None) is not None:
        return False
    defined = getattr(sys.modules.get(cls.__module__), cls.__qualname__, None)
    return defined is cls and "forward" in cls.__dict__ and \
        cls.forward.__code__.co_filename == sys.modules[cls.__module__].__file__


def _fp32_operands(head, hidden, weight):
    """The operands ``head``'s forward multiplies (:data:`_FP32_OUTPUT_HEADS`)."""
    if head.cast_input_to_weight_dtype:
        hidden = hidden.to(weight.dtype)
    return hidden.float(), weight.to(hidden.dtype).float()


def _plain_linear(module: nn.Module, name: str, owners=None, check_only: bool = False):
    linear_forward = type(module).forward is nn.Linear.forward or fp32_output_head(module)
    if not isinstance(module, nn.Linear) or not linear_forward or _own_call(module):
        raise UnsupportedModelError(
            f"{name} is a {type(module).__module__}.{type(module).__qualname__}; the fused loss "
            f"supports a plain torch.nn.Linear head (also inside PEFT modules_to_save or LoRA), "
            f"because it reads the weight instead of calling the module. {_ESCAPE}"
        )
    replaced = _linear_replaced()
    if replaced:
        raise UnsupportedModelError(
            f"{replaced} was replaced process-wide; {name}'s call would run the replacement, "
            f"which the fused loss bypasses. {_ESCAPE}"
        )
    _check_no_hooks(module, name, owners)
    # A parametrized weight (torch.nn.utils.parametrize) is computed on every read, and some
    # parametrizations update state when read in training (spectral_norm's power iteration):
    # the stock call reads it once, so only the read the loss uses may evaluate it (the bias
    # too: F.linear reads weight, then bias).
    weight = _unevaluated(module, "weight") if check_only else module.weight
    if weight is not None and weight.device.type == "meta":
        raise UnsupportedModelError(
            f"{name}.weight is on the meta device (offloaded by a device_map?); the fused loss "
            f"needs the materialised weight. {_ESCAPE}"
        )
    bias = _unevaluated(module, "bias") if check_only else getattr(module, "bias", None)
    for pname, tensor in (("weight", weight), ("bias", bias)):
        custom = custom_torch_function(tensor)
        if custom:
            raise UnsupportedModelError(
                f"{name}.{pname} is a {custom} with its own __torch_function__ (fake "
                f"quantisation, QAT?), which changes what {name}'s F.linear computes; the "
                f"fused loss reads the tensor and would bypass it. {_ESCAPE}"
            )
    if check_only:
        return None, None
    return weight, bias


_TENSOR_TORCH_FUNCTION = torch.Tensor.__torch_function__.__func__


def custom_torch_function(tensor) -> str:
    """The qualified type name of ``tensor`` when that type overrides ``__torch_function__``
    (so torch functions such as ``F.linear`` called on it run its code), else "".

    ``torch.Tensor``'s own and the disabled implementation (``nn.Parameter``, ``DTensor``,
    FSDP1's ``FlatParameter``, DeepSpeed's and PEFT's parameters, which are plain Parameters)
    are torch's default handling."""
    kind = type(tensor)
    if tensor is None or kind is nn.Parameter or kind is torch.Tensor:
        return ""
    impl = getattr(type(tensor), "__torch_function__", None)
    if impl is torch._C._disabled_torch_function_impl or \
            getattr(impl, "__func__", None) is _TENSOR_TORCH_FUNCTION:
        return ""
    return f"{type(tensor).__module__}.{type(tensor).__qualname__}"


# nn.Module's call machinery as torch defines it, recorded at import (a replacement made
# process-wide later would otherwise compare equal to itself).
_MODULE_CALL = (nn.Module.__call__, nn.Module._call_impl, nn.Module._wrapped_call_impl)


def _own_call(module: nn.Module) -> bool:
    """Whether calling ``module`` runs something other than ``nn.Module``'s call machinery
    around ``forward``: a class (or ``nn.Module`` itself, process-wide) whose ``__call__`` /
    ``_call_impl`` is not torch's, an instance attribute shadowing them, or a compiled call
    (``_compiled_call_impl``) other than ``module.compile()``'s of its own ``_call_impl``."""
    cls = type(module)
    if (cls.__call__, cls._call_impl, cls._wrapped_call_impl) != _MODULE_CALL or \
            "_call_impl" in module.__dict__ or "_wrapped_call_impl" in module.__dict__:
        return True
    compiled = module.__dict__.get("_compiled_call_impl")
    if compiled is None:
        return False
    inner = getattr(compiled, "_torchdynamo_orig_callable", None)
    return getattr(inner, "__func__", None) is not _MODULE_CALL[1] or \
        getattr(inner, "__self__", None) is not module


# Recorded at import, checked by identity per call (torch.compile traces identity tests, not
# code-object reads); one replaced before this import is caught by its origin here.
_LINEAR_FORWARD = nn.Linear.forward
_LINEAR_FORWARD_IS_TORCH = defined_in(_LINEAR_FORWARD, "torch.nn.modules.linear",
                                       "Linear.forward")


def _linear_replaced() -> str:
    """What ``nn.Linear``'s call computes with that was replaced process-wide ("" when none):
    ``nn.Linear.forward`` and ``torch.nn.functional.linear`` against torch's own. DeepSpeed
    ZeRO-3's ``zero3_linear_wrap`` (installed as ``F.linear`` by ``zero.Init``; the same
    ``x Wᵀ + b`` with less saved for backward, DeepSpeed 0.19 ``runtime/zero/linear.py``) is
    not a replacement of what is computed."""
    if nn.Linear.forward is not _LINEAR_FORWARD or not _LINEAR_FORWARD_IS_TORCH:
        return "torch.nn.Linear.forward"
    if getattr(sys.modules.get("torch.nn.modules.linear"), "F", None) is not torch.nn.functional:
        return "torch.nn.modules.linear.F (what nn.Linear.forward calls)"
    linear = torch.nn.functional.linear
    if linear is not torch._C._nn.linear and not (
            getattr(linear, "__module__", None) == "deepspeed.runtime.zero.linear"
            and getattr(linear, "__qualname__", None) == "zero3_linear_wrap"):
        return "torch.nn.functional.linear"
    return ""


def parametrized(module: nn.Module, pname: str = "weight") -> bool:
    """Whether ``module.pname`` is computed by a ``torch.nn.utils.parametrize`` parametrization
    on each read."""
    if _module_lacks(module, "parametrizations"):
        return False  # getattr below would raise and catch an AttributeError (a microsecond)
    parametrizations = getattr(module, "parametrizations", None)
    return parametrizations is not None and pname in parametrizations


def parametrized_anywhere(module: nn.Module) -> bool:
    """Whether a ``torch.nn.utils.parametrize`` parametrization computes some tensor of
    ``module`` or of a module inside it (a LoRA layer's base layer): reading ``module.weight``
    or ``module.bias`` may then evaluate it, which stock does once per call, in the head's
    ``F.linear``, so only the loss's own read may."""
    for m in module.modules():
        if not _module_lacks(m, "parametrizations") and getattr(m, "parametrizations", None):
            return True
    return False


_MODULE_GETATTR = nn.Module.__getattr__
_GENERIC_GETATTRIBUTE = object.__getattribute__
_MODULE_STORES = ("_parameters", "_buffers", "_modules")


def _module_lacks(module, name: str) -> bool:
    """True only when ``getattr(module, name)`` raises ``AttributeError`` without running any
    code of the module's: its class keeps Python's attribute lookup and ``nn.Module.__getattr__``
    (which looks in ``_parameters``, ``_buffers``, ``_modules``, torch 2.x), and ``name`` is in
    none of the classes of its MRO, its ``__dict__`` or those three. False when unsure."""
    cls = type(module)
    if cls.__getattr__ is not _MODULE_GETATTR or cls.__getattribute__ is not _GENERIC_GETATTRIBUTE:
        return False
    d = module.__dict__
    if name in d:
        return False
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return False
    for store in _MODULE_STORES:
        if name in d.get(store, ()):
            return False
    return True


def _unevaluated(module: nn.Module, pname: str):
    """``module``'s tensor ``pname`` for the device check, without running a parametrization
    on it: the parametrized tensor's ``original`` (None where it has several)."""
    if parametrized(module, pname):
        return getattr(module.parametrizations[pname], "original", None)
    return getattr(module, pname, None)


def _active_module_to_save(wrapper):
    # Mirrors the wrapper's own forward: the original module while adapters are disabled or
    # none is active, else the copy of the first active adapter.
    if wrapper.disable_adapters or not wrapper.active_adapters:
        return wrapper.original_module, "original_module"
    name = wrapper.active_adapters[0]
    return wrapper.modules_to_save[name], f"modules_to_save[{name!r}]"


def check_head(head: nn.Module, name: str = "lm_head") -> None:
    """Raise now if :func:`fused_head_loss` would refuse ``head`` (used at apply time).

    Raises:
        UnsupportedModelError: the head cannot be expressed as one linear map here.
    """
    _resolve(head, name, check_only=True, owners=[])


def head_operands(head: nn.Module, hidden: torch.Tensor, name: str = "lm_head"):
    """``(hidden, weight, bias)`` such that ``hidden @ weight.T + bias`` equals ``head(hidden)``.

    Args:
        head: the module returned by ``model.get_output_embeddings()``.
        hidden: ``[..., H]`` last hidden states already sliced by ``logits_to_keep``.
        name: how error messages name the head.

    Returns:
        ``hidden`` ``[..., H]`` (``[..., H + r]`` with LoRA adapters, the low-rank inputs
        appended), ``weight`` ``[V, H]`` (``[V, H + r]``), and ``bias`` ``[V]`` or None.
        Adapter dropout is applied here, so call this once per forward.

    Raises:
        UnsupportedModelError: DoRA/variants, other PEFT tuners, trainable-token wrappers,
            quantised or custom heads, heads with forward hooks, meta-device weights.
    """
    return _resolve(head, name, hidden=hidden)


def fused_head_loss(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    logit_scale: float | None = None,
    name: str = "lm_head",
    **loss_kwargs,
) -> tuple[torch.Tensor, int]:
    """The fused cross-entropy of ``head(hidden)`` against ``labels``, reading the head's
    parameters the way the module that owns them intends.

    The operands come from :func:`head_operands` (PEFT LoRA / modules_to_save included). When a
    module on the way to the weight is owned by a wrapper that gathers parameters in its call
    (FSDP1, FSDP2 ``fully_shard``, DeepSpeed ZeRO-3), the loss is computed inside that module's
    own ``__call__`` (its ``forward`` bound to the loss for this one call), so the wrapper
    gathers before, frees after, and in backward re-gathers and reduce-scatters the gradient
    exactly as it does after ``lm_head(hidden)``. A plain head is read directly (no call).

    Args:
        head: the module returned by ``model.get_output_embeddings()``.
        hidden: ``[..., H]`` last hidden states already sliced by ``logits_to_keep``; moved to
            the weight's device when a device map put them elsewhere.
        labels: ``hidden.shape[:-1]`` integer targets (moved to the weight's device).
        logit_scale: multiply the logits by this (``(s h) Wᵀ + s b``), or None.
        name: how error messages name the head.
        **loss_kwargs: keyword options of :func:`~fused_ce_patch.fused_linear_cross_entropy`
            (``ignore_index``, ``num_items_in_batch``, ``shift``, ``softcap``, ``backend``, ...).

    Returns:
        ``(loss, vocab_size)``: the loss as :func:`~fused_ce_patch.fused_linear_cross_entropy`
        returns it, and ``V`` of the (gathered) weight.

    Raises:
        UnsupportedModelError: as :func:`head_operands`, hooks of unknown purpose, or a weight
            that is still a shard when read (names FSDP2/DTensor, ZeRO-3 or FSDP1).
    """
    owners: list = []
    _resolve(head, name, check_only=True, owners=owners)
    vocab = []
    tensor_parallel = tp_head_layout(head, name) is not None

    def loss_of(h):
        h, weight, bias = _resolve(head, name, hidden=h, owners=[])
        if tensor_parallel:
            return _vocab_parallel_loss(h, weight, bias, labels, logit_scale, name, vocab,
                                        loss_kwargs)
        _check_gathered(weight, h, name, owners)
        if h.device != weight.device:  # model split over devices: do what lm_head's hook would
            h = h.to(weight.device)
        if logit_scale is not None:  # (s h) W^T + s b = s (h W^T + b)
            h = h * logit_scale
            bias = None if bias is None else bias * logit_scale
        vocab.append(weight.shape[0])
        if fp32_output_head(head):  # its forward multiplies in float32 with autocast off
            with torch.autocast(h.device.type, enabled=False):
                return fused_linear_cross_entropy(
                    h, weight, labels.to(h.device), bias=bias, **loss_kwargs)
        return fused_linear_cross_entropy(
            h, weight, labels.to(h.device), bias=bias, **loss_kwargs
        )

    loss = _within(owners, hidden, loss_of)
    return loss, vocab[-1]


def _vocab_parallel_loss(hidden, weight, bias, labels, logit_scale, name, vocab, loss_kwargs):
    """The loss of a tensor-parallel head from this rank's vocabulary shard (module docstring).

    ``backend`` is not used: the shard's chunks are computed with the ``torch`` backend's
    arithmetic, which runs on every device."""
    from torch.distributed.tensor import DTensor, Replicate

    try:
        weight, bias, start, size, group = dtensor_vocab_shard(weight, bias)
    except ValueError as exc:
        raise UnsupportedModelError(f"{name} under tensor parallelism: {exc}. {_ESCAPE}") from exc
    if isinstance(hidden, DTensor):
        if tuple(hidden.placements) != (Replicate(),):
            raise UnsupportedModelError(
                f"the hidden states reaching the tensor-parallel {name} are a DTensor with "
                f"placements {tuple(hidden.placements)} (sequence parallelism?); the fused loss "
                f"needs them replicated. {_ESCAPE}"
            )
        hidden = hidden.to_local()
    if hidden.device != weight.device:
        hidden = hidden.to(weight.device)
    options = {k: v for k, v in loss_kwargs.items() if k != "backend"}
    vocab.append(size)
    return vocab_parallel_linear_cross_entropy(
        hidden, weight, labels.to(hidden.device), vocab_start=start, vocab_size=size,
        group=group, bias_shard=bias, logit_scale=logit_scale, **options,
    )


def _within(owners, hidden, fn):
    """``fn(hidden)`` run inside the call of every ``(called, bound)`` owner, outermost first."""
    if not owners:
        return fn(hidden)
    (called, bound), rest = owners[0], owners[1:]
    previous = bound.__dict__.get("forward")

    def forward(h, *args, **kwargs):
        _restore(bound, previous)  # anything the loss calls sees the module's own forward
        return _within(rest, h, fn)  # ``h`` as the owner's hooks passed it (cast, hooked)

    bound.forward = forward
    try:
        return called(hidden)
    finally:
        _restore(bound, previous)


def _restore(module, previous):
    if previous is not None:
        module.__dict__["forward"] = previous
    else:
        module.__dict__.pop("forward", None)


def _check_gathered(weight, hidden, name, owners):
    # Never train on a shard: each wrapper's placeholder looks different.
    if type(weight).__name__ == "DTensor":
        mode = _modes(owners)
        raise UnsupportedModelError(
            f"{name}.weight is a DTensor (sharded by FSDP2 fully_shard, or by tensor "
            f"parallelism on a head that is not itself transformers' colwise_gather_output "
            f"layer) when the fused loss reads it ({mode}); the fused loss needs the gathered "
            f"weight. fully_shard the head's parent (or lm_head itself) so its call gathers it. "
            f"{_ESCAPE}"
        )
    status = getattr(weight, "ds_status", None)
    if status is not None and getattr(status, "name", "") != "AVAILABLE":
        mode = _modes(owners)
        raise UnsupportedModelError(
            f"{name}.weight is a DeepSpeed ZeRO-3 partition ({status.name}) when the fused loss "
            f"reads it ({mode}). {_ESCAPE}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.numel() == 0:
        mode = _modes(owners)
        raise UnsupportedModelError(
            f"{name}.weight has shape {tuple(weight.shape)} for hidden states "
            f"{tuple(hidden.shape)}: a shard or flat placeholder (FSDP1 flat parameter, ZeRO-3 "
            f"partition?) rather than the gathered [V, H] weight ({mode}). {_ESCAPE}"
        )


def _modes(owners) -> str:
    """The gathering wrappers of ``owners``, for an error message (only then: it costs)."""
    return ", ".join(sorted({_mode(o) for o in owners})) or "no gathering wrapper found"


def _mode(owner) -> str:
    called = owner[0]
    fsdp1 = _fsdp1_class()
    if fsdp1 is not None and isinstance(called, fsdp1):
        return "FSDP1"
    kinds = {_gatherer(h) for h in (*called._forward_pre_hooks.values(),
                                     *called._forward_hooks.values())}
    return ", ".join(sorted(k for k in kinds if k)) or type(called).__name__


def _resolve(head, name, hidden=None, check_only=False, owners=None):
    fsdp1 = _fsdp1_class()
    if fsdp1 is not None and isinstance(head, fsdp1):
        if owners is None:
            raise UnsupportedModelError(
                f"{name} is wrapped in FSDP1 (FullyShardedDataParallel), whose parameters are "
                f"gathered only inside its call; use fused_head_loss. {_ESCAPE}"
            )
        _check_no_hooks(head, name, owners)
        inner = head._fsdp_wrapped_module
        _no_fp32_inside(inner, name)
        owners.append((head, inner))  # FSDP1 gathers in its forward, which calls ``inner``
        return _resolve(inner, f"{name}._fsdp_wrapped_module", hidden, check_only, owners)
    peft = _peft_classes()
    if peft is not None:
        base_tuner, aux_wrapper, modules_to_save_cls, lora_linear = peft
        if isinstance(head, modules_to_save_cls):
            _check_no_hooks(head, name, owners)
            inner, which = _active_module_to_save(head)
            _no_fp32_inside(inner, name)
            return _resolve(inner, f"{name}.{which}", hidden, check_only, owners)
        if isinstance(head, aux_wrapper):
            raise UnsupportedModelError(
                f"{name} is wrapped by PEFT's {type(head).__name__} (e.g. trainable_token_indices "
                f"on a tied head), whose weight is not a plain parameter. {_ESCAPE}"
            )
        if isinstance(head, lora_linear):
            return _lora(head, name, hidden, check_only, owners)
        if isinstance(head, base_tuner):
            raise UnsupportedModelError(
                f"{name} is a PEFT {type(head).__module__}.{type(head).__name__} layer; only "
                f"plain LoRA (lora.Linear) on the head is folded into the fused loss. {_ESCAPE}"
            )
    weight, bias = _plain_linear(head, name, owners, check_only)
    if check_only:
        return None
    if fp32_output_head(head):
        hidden, weight = _fp32_operands(head, hidden, weight)
    return hidden, weight, bias


def _no_fp32_inside(inner, name):
    # the fused call runs with autocast off only for the float32-output head itself
    if fp32_output_head(inner):
        raise UnsupportedModelError(
            f"{name} wraps a float32-output head ({type(inner).__qualname__}); the fused loss "
            f"takes such a head only unwrapped. {_ESCAPE}")


def _lora(head, name, hidden, check_only, owners):
    _check_no_hooks(head, name, owners)
    base = head.get_base_layer()
    _no_fp32_inside(base, name)
    if tp_head_layout(base, f"{name}.base_layer") is not None:
        # the LoRA weights are whole, the base weight a vocabulary shard (stock's PEFT forward
        # fails on it too); refused before the operands are joined, at apply and call time
        raise UnsupportedModelError(
            f"{name} carries PEFT LoRA around a tensor-parallel head (transformers' "
            f"colwise_gather_output, weight a vocabulary shard); the fused loss does not "
            f"combine LoRA adapters with a vocabulary-parallel head. {_ESCAPE}"
        )
    if head.disable_adapters or head.merged:
        if head.disable_adapters and head.merged and not check_only:
            head.unmerge()  # what lora.Linear.forward itself does before using the base layer
        return _resolve(base, f"{name}.base_layer", hidden, check_only, owners)
    active = [a for a in head.active_adapters if a in head.lora_A]
    variants = getattr(head, "lora_variant", {})
    dora = getattr(head, "use_dora", {})
    for adapter in active:
        if adapter in variants or dora.get(adapter, False):
            kind = type(variants[adapter]).__name__ if adapter in variants else "DoRA"
            raise UnsupportedModelError(
                f"{name} carries the LoRA variant {kind} for adapter {adapter!r}; only vanilla "
                f"LoRA on the head is folded into the fused loss. {_ESCAPE}"
            )
    out = _resolve(base, f"{name}.base_layer", hidden, check_only, owners)
    for adapter in active:  # lora_A is called below (its own hooks run); lora_B is read
        _check_no_hooks(head.lora_B[adapter], f"{name}.lora_B[{adapter!r}]", owners)
        for pname in ("weight", "bias"):  # stored tensors: a parametrization runs once, below
            custom = custom_torch_function(_unevaluated(head.lora_B[adapter], pname))
            if custom:
                raise UnsupportedModelError(
                    f"{name}.lora_B[{adapter!r}].{pname} is a {custom} with its own "
                    f"__torch_function__, which the fused loss would bypass. {_ESCAPE}")
    if check_only or not active:
        return out
    hidden, weight, bias = out
    hs, ws = [hidden], [weight]
    for adapter in active:
        lora_a, lora_b = head.lora_A[adapter], head.lora_B[adapter]
        scale = head.scaling[adapter]
        x = hidden.to(lora_a.weight.dtype)
        low = lora_a(head.lora_dropout[adapter](x)) * scale  # [..., r]
        hs.append(low.to(hidden.dtype))
        ws.append(lora_b.weight.to(weight.dtype))
        if lora_b.bias is not None:  # lora_bias=True: scale * b_B joins the head bias
            extra = (lora_b.bias * scale).to(weight.dtype)
            bias = extra if bias is None else bias + extra
    return torch.cat(hs, dim=-1), torch.cat(ws, dim=1), bias


def fused_head_lse(
    head: nn.Module,
    hidden: torch.Tensor,
    *,
    name: str = "lm_head",
    logits_budget: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-position ``logsumexp`` of ``head(hidden)`` over the vocabulary, without the logits.

    From :func:`~fused_ce_patch.fused_linear_token_stats` with every label 0:
    ``LSE = z_0 - log p_0`` where ``z_0 = h·W[0] (+ b[0])`` is gathered directly — for 16-bit
    inputs as the kernels form their logits, the product rounded to the input dtype, so the
    result is the log-sum-exp of those logits (stock's 16-bit logits) up to float32 rounding;
    the gradient is autograd's of that difference (``softmax(z)·W`` for ``h`` in exact
    arithmetic).

    Only for a head read directly from its own weight: a plain ``nn.Linear`` with no
    parameter-gathering owner, no tensor-parallel layout, no parametrization and no adapter
    (a LoRA head's dropout would be drawn a second time in this call).

    Args:
        head: the module returned by ``model.get_output_embeddings()``.
        hidden: ``[..., H]`` hidden states on the weight's device, its dtype.
        name: how error messages name the head.
        logits_budget, backend: as :func:`~fused_ce_patch.fused_linear_token_stats`.

    Returns:
        ``[...]`` float32 (float64 for float64 inputs) log-sum-exp per position.

    Raises:
        UnsupportedModelError: the head is not such a plain linear map (names why).
    """
    owners: list = []
    _resolve(head, name, check_only=True, owners=owners)
    weight = getattr(head, "weight", None)
    why = None
    if not isinstance(head, nn.Linear) or fp32_output_head(head):
        why = f"a {type(head).__qualname__}"
    elif owners or tp_head_layout(head, name) is not None:
        why = "sharded or gathered by a wrapper"
    elif parametrized_anywhere(head):
        why = "parametrized"
    elif type(weight).__name__ == "DTensor" or weight.device != hidden.device:
        why = f"on {weight.device}, the hidden states on {hidden.device}"
    if why is not None:
        raise UnsupportedModelError(
            f"the fused log-sum-exp reads a plain nn.Linear {name} directly; {name} is {why}")
    bias = head.bias
    zeros = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
    stats = fused_linear_token_stats(hidden, weight, zeros, bias=bias,
                                     logits_budget=logits_budget, backend=backend)
    acc = stats.log_probs.dtype
    if backend == "reference" or hidden.dtype == acc:
        z0 = hidden.to(acc) @ weight[0].to(acc)
    else:
        # the kernels' logits are the product in the input dtype, rounded to it (bf16/fp16):
        # z_0 rounded the same way, so that z_0 - log p_0 is the log-sum-exp of those logits
        # (the unrounded z_0 added its bf16 rounding, ~|z_0| 2**-9, to every position)
        z0 = (hidden @ weight[:1].t()).squeeze(-1).to(acc)
    if bias is not None:
        z0 = z0 + bias[0].to(acc)
    return z0 - stats.log_probs

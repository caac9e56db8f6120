"""Turning the fused loss on and off: per instance, per architecture class.

- :func:`apply_fused_ce` / :func:`revert_fused_ce` patch one model instance (plain, PEFT-wrapped,
  DDP/FSDP/compiled, or already prepared by accelerate). The patch lives in the instance's
  ``__dict__`` (``forward`` plus a state attribute), so other instances of the class are left
  alone, applying twice is a no-op, and reverting restores the exact objects found.
- ``apply_fused_ce_to_<arch>()`` patch the architecture class itself (every instance, like
  Liger's ``apply_liger_kernel_to_<arch>``); :func:`revert_fused_ce` given the class undoes it.

A patched model (or a patched class's instances) computes a materialised-logits loss with
:func:`~fused_ce_patch.hf.loss_mapping.chunked_causal_lm_loss` through its own
``loss_function``; transformers' ``LOSS_MAPPING`` is never changed (see
:mod:`~fused_ce_patch.hf.loss_mapping`), so nothing outside what was patched notices a patch.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import sys
import weakref
from types import MethodType

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..types import BackendName
from . import loss_mapping
from . import proof, registry
from .architectures import ARCHITECTURES, ArchSpec, derive_spec
from .forward import STATE_ATTR, FusedCEOptions, class_slot, patched_forward
from .loss_mapping import apply_fused_ce_to_loss_mapping  # noqa: F401 - public, re-exported
from .registry import is_patched_forward, stock_forward_of, wraps_patched
from .head import check_head
from .head_path import head_path

__all__ = [
    "apply_fused_ce",
    "revert_fused_ce",
    "apply_fused_ce_to_llama",
    "apply_fused_ce_to_qwen2",
    "apply_fused_ce_to_gemma2",
    "apply_fused_ce_to_gemma3",
    "apply_fused_ce_to_mistral",
    "apply_fused_ce_to_class",
    "is_fused_ce_applied",
    "apply_fused_ce_to_loss_mapping",
    "FusedCEOptions",
]

logger = logging.getLogger(__name__)

class _NoOwner:
    """Stands in for the owner of a state deep-copied without its model."""


_NO_OWNER = _NoOwner()
_PATCHED_INSTANCES = registry.PATCHED_INSTANCES
_PATCHED_CLASSES = registry.PATCHED_CLASSES
_MISSING = registry.MISSING


def _unpickled_state():
    return None


class _InstanceState:
    __slots__ = ("options", "slot", "previous", "installed", "loss", "owner", "stock",
                 "head_forwards", "__weakref__")

    def __init__(self, options, slot, previous, installed, loss, owner, stock=None,
                 head_forwards=None):
        self.options = options
        self.stock = stock  # the class forward the instance was patched against
        # the class forwards from the head module to the projection, as analysed at apply
        # (None: the head is the projection)
        self.head_forwards = head_forwards
        self.slot = slot  # "forward", or "_old_forward" under accelerate dispatch hooks
        self.previous = previous  # what was in the instance __dict__ under `slot` before
        self.installed = installed  # what apply_fused_ce put there
        self.loss = loss  # the InstanceLoss put in `_loss_function`, or None
        self.owner = weakref.ref(owner)

    def __deepcopy__(self, memo):
        # The copied model's bound methods are rebound to the copy through `memo`; the copy is
        # already in `memo` (copy._reconstruct registers it before copying its __dict__), so it
        # is tracked like the original and `revert_fused_ce()` reaches it.
        owner = self.owner()
        clone = memo.get(id(owner)) if owner is not None else None
        state = _InstanceState(
            copy.deepcopy(self.options, memo), self.slot,
            copy.deepcopy(self.previous, memo), copy.deepcopy(self.installed, memo),
            copy.deepcopy(self.loss, memo), clone if isinstance(clone, nn.Module) else _NO_OWNER,
            self.stock, self.head_forwards,
        )
        if isinstance(clone, nn.Module):
            _PATCHED_INSTANCES.add(clone)
            trl_routing = sys.modules.get("fused_ce_patch.hf.trl")
            if trl_routing is not None:  # the copy keeps TRL's routers alive like the original
                trl_routing._watch_patched_instances()
        return state

    def __reduce__(self):
        # pickle stores a bound method by name, so the patched forward comes back as the stock
        # one: the unpickled model is unpatched, and says so (apply_fused_ce patches it again).
        return (_unpickled_state, ())


def make_options(backend, logits_budget, return_logits) -> FusedCEOptions:
    from ..loss import check_backend_name, check_logits_budget

    check_backend_name(backend)
    check_logits_budget(logits_budget)
    if not isinstance(return_logits, bool):  # "no" is truthy: it would silently keep logits
        raise TypeError(f"return_logits must be True or False, got {return_logits!r}")
    return FusedCEOptions(backend=backend, logits_budget=logits_budget,
                          return_logits=return_logits)


# -- finding the causal LM inside wrappers ---------------------------------------------------


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside ``model``'s wrappers.

    Peels ``torch.compile`` (``_orig_mod``), DDP / DataParallel / FSDP / DeepSpeed engines
    (``.module``) and PEFT (``PeftModel.get_base_model()``, ``PeftMixedModel``, a bare tuner's
    ``.model``), in any nesting.
    """
    wrappers = [nn.parallel.DistributedDataParallel, nn.DataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers.append(FullyShardedDataParallel)
    except ImportError:
        pass
    if "deepspeed" in sys.modules:
        wrappers.append(sys.modules["deepspeed"].DeepSpeedEngine)
    peft = sys.modules.get("peft")
    for _ in range(16):
        if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod  # torch.compile(model)
        elif isinstance(model, tuple(wrappers)):
            model = model.module
        elif peft is not None and isinstance(model, peft.PeftModel):
            model = model.get_base_model()
        elif peft is not None and isinstance(model, getattr(peft, "PeftMixedModel", ())):
            model = model.base_model.model
        elif peft is not None and isinstance(model, peft.tuners.tuners_utils.BaseTuner):
            model = model.model
        else:
            return model
    return model


def _supported_list() -> str:
    # No fixed list: any class whose forward derives and passes the proof (hf/proof.py) is
    # patched; docs/support.md records which types passed on which transformers releases.
    named = ", ".join(repr(t) for t in ARCHITECTURES)
    return (f"any whose forward derives and passes the parity proof, e.g. {named} "
            f"(docs/support.md lists those proven on each transformers release)")


def output_embeddings(target):
    """``target.get_output_embeddings()``, or UnsupportedModelError where that call raises (a
    RoBERTa whose ``lm_head`` was replaced by a plain module: its method reads
    ``lm_head.decoder``); stock's forward never calls it, so the model still trains stock.

    Raises:
        UnsupportedModelError: the call raised (the message names its exception).
    """
    try:
        return target.get_output_embeddings()
    except Exception as exc:  # noqa: BLE001 - any failure of a method stock never calls
        raise UnsupportedModelError(
            f"fused_ce_patch cannot patch {type(target).__name__}: its "
            f"get_output_embeddings() raises {type(exc).__name__}: {str(exc)[:120]} (the fused "
            f"loss reads the vocabulary projection it returns)") from exc


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """What :func:`apply_fused_ce` patches one instance by (:func:`instance_spec`).

    Attributes:
        spec: the class's derived spec; for a head module with a transform before the
            projection, its ``fingerprint`` also covers the analysed head forwards (so a
            changed head forward is proven again).
        stock: the stock forward the spec was derived from.
        head: ``get_output_embeddings()``, the vocabulary projection.
        path: how the head module reaches ``head`` (:mod:`.head_path`), or None when the
            forward calls ``head`` itself.
    """

    spec: ArchSpec
    stock: object
    head: nn.Module
    path: object


def instance_spec(target) -> InstanceSpec:
    """Derive what patching ``target`` (an unwrapped causal LM) means, without proving it.

    The one place that decides the proof's key for an instance: :func:`apply_fused_ce` and
    the Trainer flag's refusal check prove with the spec returned here, so one proof serves
    both.

    Raises:
        UnsupportedModelError: the class is refused (:func:`spec_for_class` without the
            proof), its forward is not the one derived from, ``get_output_embeddings()``
            raises, or the head module's call cannot be split into a transform followed by
            the projection (:func:`~.head_path.head_path`).
    """
    model_type = getattr(getattr(target, "config", None), "model_type", None)
    spec = spec_for_class(type(target), model_type, check_verified=False)
    stock = _stock_forward(type(target), spec)
    head = output_embeddings(target)
    path = None
    if getattr(target, spec.head_attr, None) is not head:
        # a head module with a transform before the projection (RoBERTa, BERT): the fused
        # loss takes the projection's input; its analysed forwards are part of what is proven
        path = head_path(target, spec.head_attr, head)
        spec = dataclasses.replace(spec, fingerprint=hashlib.sha256(
            f"{spec.fingerprint}\0{path.fingerprint}".encode()).hexdigest()[:16])
    return InstanceSpec(spec, stock, head, path)


def prove_instance(target, found: InstanceSpec) -> None:
    """:func:`~.proof.ensure_proven` of ``target``'s class under ``found.spec`` (memo and disk
    cache first), built from ``target``'s config, retried on its device.

    Raises:
        UnsupportedModelError: as :func:`~.proof.ensure_proven`.
    """
    config = getattr(target, "config", None)
    proof.ensure_proven(type(target), found.spec, getattr(config, "model_type", None),
                        model_device(target), config)


def model_device(model) -> torch.device | None:
    """The device of ``model``'s first parameter (where a proof may run again), or None."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError, TypeError):
        return None


def spec_for_class(cls: type, model_type: str | None = None, *, check_verified: bool = True,
                   device=None, config=None):
    """Derive ``cls``'s spec (:func:`~.architectures.derive_spec`) and prove it on this machine.

    With ``check_verified`` the patched copy is compared with the live stock class on a tiny
    model (:func:`~.proof.ensure_proven`, cached per process and on disk); on the CPU, and again
    on ``device`` (the model's) where the stock forward cannot run on the CPU; built from
    ``config`` (the instance's) where given, else from the class's default config.

    Raises:
        UnsupportedModelError: not a transformers causal LM, a forward of unknown shape, or a
            class whose patched copy differs from its stock forward, or of which no tiny model
            could be built (the reason in the message).
    """
    what = f"{cls.__name__} (model_type {model_type!r})" if model_type else cls.__name__
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)) or not hasattr(
        cls, "get_output_embeddings"
    ):
        raise UnsupportedModelError(f"fused_ce_patch cannot patch {what}: not a transformers "
                                    f"model; supported model types: {_supported_list()}")
    owner = next((k for k in cls.__mro__ if "forward" in k.__dict__), cls)
    if not owner.__module__.startswith("transformers."):
        stock_owner = next((k for k in owner.__mro__[1:] if "forward" in k.__dict__), None)
        raise UnsupportedModelError(
            f"fused_ce_patch cannot patch {what}: {owner.__qualname__} overrides "
            f"{getattr(stock_owner, '__name__', '?')}.forward; only transformers' own forwards "
            f"are patched (the fused forward is a rewrite of their source); supported model types: "
            f"{_supported_list()}"
        )
    replaced = stock_forward_of(owner.__dict__.get("forward"))
    if _is_liger(replaced):  # Liger's class-level lce_forward: its own fused loss
        raise _liger_error(what, replaced, "on the class")
    try:
        spec = derive_spec(cls)
    except UnsupportedModelError as exc:
        raise type(exc)(
            f"fused_ce_patch cannot patch {what}: {exc}; supported model types: "
            f"{_supported_list()}"
        ) from None
    if not check_verified:
        return spec
    proof.ensure_proven(cls, spec, model_type, device, config)
    return spec


def _stock_forward(cls: type, spec: ArchSpec):
    """The stock forward the spec was derived from (``cls`` inherits it or is its owner)."""
    stock = stock_forward_of(cls.forward)
    if stock is not spec.stock:
        raise UnsupportedModelError(
            f"{cls.__qualname__}.forward is not the forward fused_ce_patch derived its patch "
            f"from ({spec.class_name}.forward)"
        )
    return stock


# -- accelerate's mixed-precision forward wrapper --------------------------------------------


def _chain(fn):
    """``fn`` and everything reachable through ``__wrapped__`` / ``__func__`` (bounded)."""
    out = []
    while fn is not None and len(out) < 32:
        out.append(fn)
        fn = getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
    return out


def _closure_values(fn):
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # empty cell
            pass
    return values


def _rewrap_accelerate_amp(current, patched, model):
    """Rebuild accelerate's autocast + fp32-output wrapper around ``patched``.

    ``Accelerator.prepare`` (native AMP) replaces ``model.forward`` with
    ``convert_outputs_to_fp32(autocast(<class forward>))`` bound to the instance
    (accelerate 1.x ``prepare_model``), binding the forward it found at that moment. To patch
    a model prepared earlier, the same autocast object is reused around the patched forward.
    Returns None when ``current`` is not such a wrapper.
    """
    if "_original_forward" not in model.__dict__ or not isinstance(current, MethodType):
        return None
    for fn in _chain(current):
        values = _closure_values(fn)
        autocast = next((v for v in values if isinstance(v, torch.autocast)), None)
        if autocast is None:
            continue
        inner = next((v for v in values if callable(v) and not isinstance(v, torch.autocast)),
                     None)
        if stock_forward_of(inner) is not stock_forward_of(patched):
            return None
        from accelerate.utils import convert_outputs_to_fp32

        return MethodType(convert_outputs_to_fp32(autocast(patched)), model)
    return None


# -- public API ------------------------------------------------------------------------------


def apply_fused_ce(
    model: nn.Module,
    *,
    backend: BackendName = "auto",
    logits_budget: int | None = None,
    return_logits: bool = False,
    _verified: bool = False,
) -> nn.Module:
    """Route one model instance's training loss through the fused linear-cross-entropy.

    Patches the causal LM inside ``model`` (PEFT, DDP/FSDP, ``torch.compile`` and accelerate
    wrappers are looked through) so that a training forward with labels computes the loss from
    the last hidden states and the lm_head weight, and returns
    :class:`~fused_ce_patch.hf.sentinel.NotMaterializedLogits` as ``outputs.logits``.
    Evaluation, no-grad calls, ``generate()`` and calls without labels return exactly the stock
    output. Other instances of the same class are not affected. Patch before
    ``accelerator.prepare`` / ``Trainer.train`` where you can (a model prepared earlier is
    handled by rebuilding accelerate's autocast wrapper around the patched forward).

    Args:
        model: a transformers causal LM whose class's forward derives and passes the proof on
            this machine (:mod:`~fused_ce_patch.hf.proof`; docs/support.md lists the
            types proven on each transformers release),
            possibly wrapped.
        backend: backend of :func:`~fused_ce_patch.fused_linear_cross_entropy`.
        logits_budget: bytes of transient logits one chunk may hold (None: backend default).
        return_logits: keep the stock path everywhere (real logits; no memory saving) while
            still computing that loss with the chunked logits loss.
            ``$FUSED_CE_RETURN_LOGITS=1`` does the same for every patched model, read at
            each eager call (under ``torch.compile``, when the forward is traced: set it
            before the first compiled call, or ``torch._dynamo.reset()`` after changing it).

    Returns:
        ``model`` itself (patched in place). Applying again is a no-op apart from taking the
        new options.

    Raises:
        UnsupportedModelError: unsupported architecture or head (lists what is supported; DoRA
            or other PEFT tuners on lm_head, quantised heads), a subclass that overrides the
            stock forward, or an instance forward replaced by something else.
        ValueError: unknown backend or a negative ``logits_budget``.
        TypeError: ``logits_budget`` not an int (a bool or a float).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_fused_ce needs a torch.nn.Module, got {type(model).__name__}")
    options = make_options(backend, logits_budget, return_logits)
    loss_mapping.capture_originals()  # eagerly: the per-call check is then by identity
    target = unwrap_causal_lm(model)
    if not (hasattr(target, "config") and hasattr(target, "get_output_embeddings")):
        raise UnsupportedModelError(
            f"fused_ce_patch cannot patch {type(target).__name__}: not a transformers causal LM "
            f"(a PreTrainedModel with get_output_embeddings()); pass the causal LM itself, "
            f"e.g. the model returned by AutoModelForCausalLM.from_pretrained"
        )
    # _verified: only the parity sweep, which is what does the verifying, skips the proof.
    found = instance_spec(target)
    spec, stock, head, path = found.spec, found.stock, found.head, found.path
    head_forwards = None if path is None else path.forwards
    if not _verified:
        prove_instance(target, found)
    check_head(head, path.names[-1] if head_forwards is not None else "lm_head")

    state = target.__dict__.get(STATE_ATTR)
    if state is not None:
        current = target.__dict__.get(state.slot, _MISSING)
        if _is_liger(current):  # Liger replaced our forward after apply_fused_ce
            raise _liger_error(type(target).__name__, current, "on this instance")
        if state.stock is stock and (current is state.installed or wraps_patched(current)
                                     or _is_trl_head(current)):
            state.options = options
            state.head_forwards = head_forwards  # a head forward replaced since: the new one
            logger.info("fused_ce_patch: %s already patched; options now %s",
                        type(target).__name__, _describe(options))
            return model
        # The class forward changed since (or the instance forward was replaced): start over
        # from what is there now.
        _revert_instance(target)

    patched = patched_forward(stock, spec)
    # accelerate's dispatch hooks (device_map over several devices) keep the model's own
    # forward in `_old_forward` and call it from a hook wrapper: patch that slot instead.
    hooked = "_hf_hook" in target.__dict__ and "_old_forward" in target.__dict__
    slot = "_old_forward" if hooked else "forward"
    previous = target.__dict__.get(slot, _MISSING)
    if previous is _MISSING:
        installed = MethodType(patched, target)
    elif any(fn is patched for fn in _chain(previous)):
        # Our forward is already inside (e.g. accelerate prepared a patched model that was
        # later reverted): only the state is missing.
        installed = previous
    elif (
        stock_forward_of(getattr(previous, "__func__", None)) is stock
        and getattr(previous, "__self__", None) is target
    ):
        # The stock forward bound to this instance (accelerate's dispatch hook, or what an
        # unpickled patched model holds): replace it, and give it back on revert.
        installed = MethodType(patched, target)
    elif _is_trl_head(previous):
        # TRL's own fused head (trl >= 1.6) stays in place; hf/trl.py routes its kernel calls
        # for this instance to fused_ce_patch.
        installed = previous
    else:
        installed = None if hooked else _rewrap_accelerate_amp(previous, patched, target)
        if installed is None and _is_liger(previous):
            raise _liger_error(type(target).__name__, previous, "on this instance")
        if installed is None:
            name, lib = _describe_forward(previous)
            raise UnsupportedModelError(
                f"{type(target).__name__}.forward was replaced on this instance by {lib}'s "
                f"{name}. Call apply_fused_ce(model) before {lib} patches the model, or turn "
                f"{lib}'s forward patch off (Liger: fused_linear_cross_entropy=False)."
            )
    target.__dict__[slot] = installed
    loss = loss_mapping.install_instance_loss(target)
    target.__dict__[STATE_ATTR] = _InstanceState(options, slot, previous, installed, loss, target,
                                                 stock, head_forwards)
    _PATCHED_INSTANCES.add(target)
    from . import trl as trl_routing

    trl_routing.install()  # now, or when TRL's trainer modules are imported (any order)
    logger.info(
        "fused_ce_patch: patched %s (model_type %r, this instance only): training loss via "
        "fused linear cross-entropy, %s",
        type(target).__name__, target.config.model_type, _describe(options),
    )
    return model


def revert_fused_ce(
    model: nn.Module | type[nn.Module] | None = None,
) -> nn.Module | type[nn.Module] | None:
    """Undo :func:`apply_fused_ce` on an instance, an ``apply_fused_ce_to_*`` on a class, or all.

    Args:
        model: a model patched by :func:`apply_fused_ce` (wrappers are looked through), a
            class patched by ``apply_fused_ce_to_<arch>()``, or None to undo every patch.

    Returns:
        ``model``. Reverting something not patched is a no-op.

    The exact objects found at apply time come back: the instance's ``forward`` and
    ``loss_function`` entries (or their absence), the class's ``forward`` and
    ``loss_function``. Deep copies of a patched model are patched and tracked too. If
    accelerate wrapped the patched forward after :func:`apply_fused_ce`, its wrapper stays in
    place but the patched forward inside it now behaves exactly as the stock forward.
    """
    if model is not None and not isinstance(model, (nn.Module, type)):
        raise TypeError(f"revert_fused_ce needs a model, a model class or None, got "
                        f"{type(model).__name__} {model!r:.80}")
    if model is None:
        for inst in list(_PATCHED_INSTANCES):
            _revert_instance(inst)
        for cls in list(_PATCHED_CLASSES):
            _revert_class(cls)
    elif isinstance(model, type):
        _revert_class(model)
    else:
        _revert_instance(unwrap_causal_lm(model))
    if model is None:
        loss_mapping.revert_loss_mapping()
    if not _PATCHED_INSTANCES and "fused_ce_patch.hf.trl" in sys.modules:
        sys.modules["fused_ce_patch.hf.trl"].release()
    return model


def _revert_instance(target):
    state = target.__dict__.pop(STATE_ATTR, None)
    _PATCHED_INSTANCES.discard(target)
    if state is None:
        return
    loss_mapping.remove_instance_loss(target, state.loss)
    if target.__dict__.get(state.slot, _MISSING) is state.installed:
        if state.previous is _MISSING:
            del target.__dict__[state.slot]
        else:
            target.__dict__[state.slot] = state.previous
    else:
        logger.info(
            "fused_ce_patch: %s.forward was wrapped again after apply_fused_ce (e.g. by "
            "accelerate); the patched forward stays inside that wrapper and now runs the stock "
            "forward", type(target).__name__,
        )


def _revert_class(cls):
    cls = next((k for k in cls.__mro__ if k in _PATCHED_CLASSES), cls)  # the owner patched
    loss_mapping.unroute_class(cls)  # even if someone replaced the patched forward since
    current = cls.__dict__.get("forward")
    if current is None or not is_patched_forward(current):
        return
    stock = stock_forward_of(current)
    _PATCHED_CLASSES.discard(cls)
    # The options live with the stock forward: keep them while another class patched on the
    # same forward (a subclass, or its parent) stays patched.
    if not any(stock_forward_of(k.__dict__.get("forward")) is stock for k in _PATCHED_CLASSES):
        class_slot(stock).options = None
    inherited = next((k.__dict__["forward"] for k in cls.__mro__[1:] if "forward" in k.__dict__),
                     None)
    if inherited is not None and stock_forward_of(inherited) is stock:
        del cls.forward  # a subclass patched on its own: inherit (stock or parent's patch) again
    else:
        cls.forward = stock


def _describe_forward(fn) -> tuple[str, str]:
    """``(qualified name, top-level package)`` of a forward, without the model's repr."""
    func = getattr(fn, "__func__", fn)
    for f in _chain(func):
        module = getattr(f, "__module__", None) or ""
        if module and not module.startswith(("functools", "fused_ce_patch")):
            return getattr(f, "__qualname__", type(f).__name__), module.split(".")[0]
    return getattr(func, "__qualname__", type(func).__name__), "another library"


def _is_liger(fn) -> bool:
    """True if ``fn`` (a forward, possibly bound or wrapped) is Liger-Kernel's."""
    return fn is not _MISSING and fn is not None and _describe_forward(fn)[1] == "liger_kernel"


def _liger_error(what: str, fn, where: str) -> UnsupportedModelError:
    """Liger's ``fused_linear_cross_entropy=True`` replaces the causal LM's forward with its
    own fused-loss forward: two fused losses cannot share one forward, and silently keeping
    either would hide which one ran."""
    name, _ = _describe_forward(fn)
    fresh = " in a fresh process (its class patch has no undo)" if where == "on the class" else ""
    return UnsupportedModelError(
        f"fused_ce_patch cannot patch {what}: Liger-Kernel's fused_linear_cross_entropy "
        f"replaced its forward {where} (liger_kernel's {name}). Apply Liger with "
        f"fused_linear_cross_entropy=False{fresh}; its other kernels combine with "
        f"fused_ce_patch."
    )


def _is_trl_head(fn) -> bool:
    if "trl" not in sys.modules:
        return False
    from .trl import is_trl_head_forward

    return is_trl_head_forward(fn)


def is_fused_ce_applied(model) -> bool:
    """True if ``model`` (an instance, wrappers looked through, or a class) is patched."""
    if isinstance(model, type):
        owner = next((k for k in model.__mro__ if "forward" in k.__dict__), None)
        return owner in _PATCHED_CLASSES and wraps_patched(owner.__dict__["forward"])
    if not isinstance(model, nn.Module):
        raise TypeError(f"is_fused_ce_applied needs a model or a model class, got "
                        f"{type(model).__name__}")
    target = unwrap_causal_lm(model)
    state = target.__dict__.get(STATE_ATTR)
    if state is not None:
        # False once another library replaced the patched forward on the instance
        current = target.__dict__.get(state.slot, _MISSING)
        # TRL's own fused head (kept, or put on after the patch) is routed to fused_ce_patch
        return state.options is not None and (current is state.installed or wraps_patched(current)
                                              or _is_trl_head(current))
    return is_fused_ce_applied(type(target))


def _apply_to_class(model_type: str, model, backend, logits_budget, return_logits):
    cls = ARCHITECTURES[model_type].model_class()
    if model is not None:
        target = unwrap_causal_lm(model)
        if not isinstance(target, cls):
            raise UnsupportedModelError(
                f"apply_fused_ce_to_{model_type.split('_')[0]} got a "
                f"{type(target).__name__} (model_type "
                f"{getattr(target.config, 'model_type', None)!r}), not a {cls.__name__}"
            )
        return apply_fused_ce(model, backend=backend, logits_budget=logits_budget,
                              return_logits=return_logits)
    apply_fused_ce_to_class(cls, backend=backend, logits_budget=logits_budget,
                            return_logits=return_logits)
    return None


def apply_fused_ce_to_class(
    cls: type,
    *,
    backend: BackendName = "auto",
    logits_budget: int | None = None,
    return_logits: bool = False,
) -> type:
    """Patch a causal-LM class (every instance, existing and future) to use the fused loss.

    The generic form of ``apply_fused_ce_to_<type>()``: any class whose forward passes the proof
    (docs/support.md), e.g. ``apply_fused_ce_to_class(Qwen3ForCausalLM)``. The forward
    is patched on ``cls`` itself: its subclasses are patched too, the classes it derives from
    are not (``apply_fused_ce_to_class(MyLlama)`` leaves other ``LlamaForCausalLM`` instances
    stock). ``revert_fused_ce(cls)`` undoes it.

    Args:
        cls: a transformers causal-LM class (``XForCausalLM``, ``XForConditionalGeneration``).
        backend: backend of :func:`~fused_ce_patch.fused_linear_cross_entropy`.
        logits_budget: bytes of transient logits one chunk may hold (None: backend default).
        return_logits: keep the stock path (real logits) everywhere.

    Returns:
        ``cls``, whose ``forward`` was patched.

    Raises:
        UnsupportedModelError: the class is not proven (reason in the message).
        ValueError: unknown backend or bad ``logits_budget``.
    """
    if not isinstance(cls, type):
        raise TypeError(f"apply_fused_ce_to_class needs a class, got {type(cls).__name__} {cls!r}")
    options = make_options(backend, logits_budget, return_logits)
    loss_mapping.capture_originals()
    spec = spec_for_class(cls)
    owner = next(k for k in cls.__mro__ if "forward" in k.__dict__)
    current = owner.__dict__["forward"]
    stock = stock_forward_of(current)
    patched = patched_forward(stock, spec)
    class_slot(stock).options = options
    if cls.__dict__.get("forward") is not patched:
        cls.forward = patched  # on cls only: a user subclass's parent stays stock
    _PATCHED_CLASSES.add(cls)
    loss_mapping.route_class(cls)
    return cls


_CLASS_DOC = """Patch every {cls} (model_type ``{mt}``) to use the fused loss{extra}.

    Class-level, like Liger's ``apply_liger_kernel_to_<arch>``: affects all instances, existing
    and future, until ``revert_fused_ce({cls})``. With ``model`` given, patches that one
    instance instead (same as :func:`apply_fused_ce`).

    Args:
        model: optional instance to patch instead of the class.
        backend: backend of :func:`~fused_ce_patch.fused_linear_cross_entropy`.
        logits_budget: bytes of transient logits one chunk may hold (None: backend default).
        return_logits: keep the stock path (real logits) everywhere.

    Returns:
        ``model`` when given, else None.

    Raises:
        UnsupportedModelError: ``model`` is not a {cls}.
        ValueError: unknown backend or a negative ``logits_budget``.
        TypeError: ``logits_budget`` not an int (a bool or a float).
    """


def _class_patcher(model_type: str, short: str, extra: str = ""):
    spec = ARCHITECTURES[model_type]  # a ClassRef: module and class name

    def apply(
        model: nn.Module | None = None,
        *,
        backend: BackendName = "auto",
        logits_budget: int | None = None,
        return_logits: bool = False,
    ) -> nn.Module | None:
        return _apply_to_class(model_type, model, backend, logits_budget, return_logits)

    apply.__name__ = apply.__qualname__ = f"apply_fused_ce_to_{short}"
    apply.__doc__ = _CLASS_DOC.format(cls=spec.class_name, mt=model_type, extra=extra)
    return apply


apply_fused_ce_to_llama = _class_patcher("llama", "llama")
apply_fused_ce_to_qwen2 = _class_patcher("qwen2", "qwen2")
apply_fused_ce_to_mistral = _class_patcher("mistral", "mistral")
apply_fused_ce_to_gemma2 = _class_patcher(
    "gemma2", "gemma2", " (with ``config.final_logit_softcapping``, 30 by default)"
)
apply_fused_ce_to_gemma3 = _class_patcher(
    "gemma3_text", "gemma3",
    " (text-only Gemma 3; ``config.final_logit_softcapping`` applied when set)",
)


def _describe(options: FusedCEOptions) -> str:
    backend = options.backend
    text = f"backend {backend!r}" + (
        " (chosen at each call from the hidden states' device: triton on CUDA, ascend on NPU, "
        "torch otherwise)" if backend == "auto" else ""
    )
    if options.logits_budget is not None:
        text += f", logits_budget {options.logits_budget} bytes"
    if options.return_logits:
        text += ", return_logits=True (real logits kept, no memory saving)"
    return text


proof.register_patcher(apply_fused_ce, revert_fused_ce)

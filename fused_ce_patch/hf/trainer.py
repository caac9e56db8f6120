"""Trainer integration: a ``use_fused_ce`` flag and the callback that acts on it.

Usage with transformers' Trainer (runs on CPU as written)::

    from fused_ce_patch import FusedCETrainingArguments

    args = FusedCETrainingArguments(output_dir="out", use_fused_ce=True, use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.train()

The flag is enough: Trainer builds its callbacks from its ``callbacks`` argument, so the
arguments object adds :class:`FusedCECallback` itself. ``Trainer.__init__`` reads
``args.should_save`` right after building its callback handler (transformers 5.17 and 5.24,
``Trainer.__init__``); the flag-carrying arguments override that property and, when the reader
is a Trainer without our callback, add one. If a future Trainer stops reading it there, the
next read of ``args.train_batch_size`` by a Trainer without the callback raises
:class:`FusedCEFlagError` at construction, never a silent unpatched run.
``callbacks=[FusedCECallback()]`` keeps working (and is the way with arguments that do not
carry the flag). For TRL, :func:`fused_ce_config` adds the flag to any config class
(``FusedCESFTConfig = fused_ce_config(trl.SFTConfig)``).

The callback patches the model in ``on_init_end`` — the end of ``Trainer.__init__``, before
``Trainer.train`` runs ``accelerate.prepare``, whose native mixed-precision wrapper binds
``model.forward`` at prepare time (accelerate 1.x ``Accelerator.prepare_model``). Token counting
stays exact: ``Trainer.__init__`` has already decided how to count ``num_items_in_batch`` by
then, and the patch leaves ``LOSS_MAPPING`` untouched, so that decision is the stock one anyway
(see :mod:`fused_ce_patch.hf.loss_mapping`). Calling ``apply_fused_ce(model)`` before building
the Trainer is equivalent. Evaluation with ``prediction_loss_only`` (no ``compute_metrics``)
computes the loss on the fused path without logits, through the ``skip_logits=True`` keyword
that Trainer passes for Liger (``Trainer.prediction_step``); whenever predictions or metrics
need logits they are real. A Trainer subclass that overrides ``compute_loss`` (not TRL's own
trainers) may read ``outputs.logits`` or pop the labels: its calls run the stock forward
(one warning), so it trains and evaluates as stock.

With ``model_init`` (a fresh model per ``train()``), Trainer re-creates the model after
``on_init_end`` and never shows callbacks the new one: patch inside ``model_init`` instead
(``return apply_fused_ce(make_model())`` or ``AutoFusedCEForCausalLM.from_pretrained``).

TRL: see :mod:`fused_ce_patch.hf.trl`. Every TRL generation computes with fused_ce_patch once
the model is patched (flag, callback or ``apply_fused_ce``): trl >= 1.15's fused LM head and
trl 1.6-1.14's ``chunked_nll`` forward call our kernel for patched models, with TRL's own loss
and metrics; with ``loss_type="nll"`` (the default up to trl 1.6, whose metrics read logits)
the callback gives the trainer TRL's own chunked head, routed to our kernel, so the loss and
both metrics come without logits.

Do not combine with Liger's fused linear cross-entropy (``use_liger_kernel=True`` with its
default config): it replaces the same forward at ``train()`` time.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import logging
import sys
import weakref
from dataclasses import dataclass, field, make_dataclass

from transformers import Trainer, TrainerCallback, TrainingArguments

from ..errors import FusedCEFlagError
from ..types import BackendName
from .forward import STATE_ATTR
from .patch import apply_fused_ce, is_fused_ce_applied, make_options, unwrap_causal_lm

logger = logging.getLogger(__name__)


def _calling_trainer(depth: int = 4):
    """The Trainer whose method is reading an argument (a few frames up), or None."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None


def _has_callback(trainer) -> bool:
    handler = getattr(trainer, "callback_handler", None)
    return handler is not None and any(
        isinstance(cb, FusedCECallback) for cb in handler.callbacks
    )


@dataclass
class FusedCEArgumentsMixin:
    """The fused-loss flag and its options, for any ``TrainingArguments`` subclass.

    Attributes:
        use_fused_ce: patch the model with :func:`~fused_ce_patch.apply_fused_ce`; the
            arguments add :class:`FusedCECallback` to the Trainer that reads them.
        fused_ce_backend: backend of the fused loss (``"auto"``, ``"torch"``, ``"triton"``,
            ``"ascend"``, ``"reference"``).
        fused_ce_logits_budget: bytes of transient logits per chunk; None = backend default.
        fused_ce_return_logits: keep real logits on every step (no memory saving).
        fused_ce_trust_compute_loss: a Trainer subclass's own ``compute_loss`` reads only
            ``outputs.loss`` of the model's forward (for instance it records something and
            calls ``super().compute_loss``): keep the fused path for it. Off (the default),
            such a ``compute_loss`` runs the stock forward, since it may read
            ``outputs.logits``.
    """

    use_fused_ce: bool = field(
        default=False,
        metadata={"help": "Compute the causal-LM training loss with fused_ce_patch's fused "
                          "linear-cross-entropy (no [tokens, vocab] logits)."},
    )
    fused_ce_backend: str = field(
        default="auto",
        metadata={"help": "Backend of the fused loss: auto, triton, ascend, torch, reference."},
    )
    fused_ce_logits_budget: int | None = field(
        default=None,
        metadata={"help": "Bytes of transient logits one chunk may hold (default: backend's)."},
    )
    fused_ce_return_logits: bool = field(
        default=False,
        metadata={"help": "Keep real logits on training steps (no memory saving)."},
    )
    fused_ce_trust_compute_loss: bool = field(
        default=False,
        metadata={"help": "A Trainer subclass's own compute_loss reads only outputs.loss: "
                          "keep the fused loss for it (default: its calls run stock)."},
    )

    def __post_init__(self):
        super().__post_init__()
        # Fail at argument parsing, not later inside Trainer.__init__. A string is not a bool
        # ("no" is truthy); HfArgumentParser converts command-line strings before this.
        for name in ("use_fused_ce", "fused_ce_return_logits", "fused_ce_trust_compute_loss"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        make_options(self.fused_ce_backend, self.fused_ce_logits_budget,
                     self.fused_ce_return_logits)

    # Trainer saves its arguments with pickle (checkpoint-*/training_args.bin). They pickle as
    # the stock class they extend, without the flag's fields, so a checkpoint loads wherever
    # transformers (and TRL, for its configs) does, with or without fused_ce_patch; copies
    # within the process keep the class and the flag.
    def __reduce_ex__(self, protocol):
        base = next(k for k in type(self).__mro__ if issubclass(k, TrainingArguments)
                    and not issubclass(k, FusedCEArgumentsMixin))
        state = {k: v for k, v in self.__dict__.items() if k not in _FLAG_FIELDS}
        return copyreg._reconstructor, (base, object, None), state

    def __copy__(self):
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone

    def __deepcopy__(self, memo):
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    # Trainer.__init__ reads `should_save` just after building its callback handler: the one
    # moment the arguments can see the Trainer and add the callback the flag needs.
    @property
    def should_save(self):
        if self.use_fused_ce:
            trainer = _calling_trainer()
            if trainer is not None and getattr(trainer, "callback_handler", None) is not None \
                    and not _has_callback(trainer):
                trainer.add_callback(FusedCECallback())
        return super().should_save

    @property
    def train_batch_size(self):
        if self.use_fused_ce:
            trainer = _calling_trainer()
            if trainer is not None and getattr(trainer, "callback_handler", None) is not None \
                    and not _has_callback(trainer):
                raise FusedCEFlagError(
                    "use_fused_ce=True but this Trainer has no FusedCECallback (this "
                    "transformers version did not let the arguments add it); pass "
                    "callbacks=[FusedCECallback()] to the Trainer"
                )
        return super().train_batch_size


_FLAG_FIELDS = ("use_fused_ce", "fused_ce_backend", "fused_ce_logits_budget",
                "fused_ce_return_logits", "fused_ce_trust_compute_loss")


@dataclass
class FusedCETrainingArguments(FusedCEArgumentsMixin, TrainingArguments):
    """``TrainingArguments`` plus the fused-loss flag and its options (see
    :class:`FusedCEArgumentsMixin`); ``HfArgumentParser`` picks the new fields up
    (``--use_fused_ce``, ``--fused_ce_backend``, ...)."""


@functools.lru_cache(maxsize=None)
def fused_ce_config(config_cls: type) -> type:
    """``config_cls`` (a ``TrainingArguments`` subclass such as TRL's ``SFTConfig``,
    ``DPOConfig``, ``GRPOConfig``) plus the ``use_fused_ce`` flag and options.

    ``FusedCESFTConfig = fused_ce_config(trl.SFTConfig)``; ``FusedCESFTConfig(...,
    use_fused_ce=True)`` then needs no callback. One class per ``config_cls`` (cached).

    Raises:
        TypeError: ``config_cls`` is not a ``TrainingArguments`` subclass.
    """
    if not (isinstance(config_cls, type) and issubclass(config_cls, TrainingArguments)):
        raise TypeError(f"fused_ce_config needs a TrainingArguments subclass, got {config_cls!r}")
    if issubclass(config_cls, FusedCEArgumentsMixin):
        return config_cls
    name = f"FusedCE{config_cls.__name__}"
    cls = make_dataclass(name, [], bases=(FusedCEArgumentsMixin, config_cls))
    cls.__module__ = __name__
    # Trainer saves its arguments with pickle (training_args.bin): make the class findable
    # by name here, and after a restart through __getattr__ below.
    _GENERATED.setdefault(name, cls)
    return _GENERATED[name]


_GENERATED: dict = {}


def __getattr__(name: str):
    """``FusedCE<Config>`` for a TRL config class, created on first use (unpickling)."""
    if name in _GENERATED:
        return _GENERATED[name]
    if name.startswith("FusedCE") and name.endswith("Config"):
        try:
            import trl

            base = getattr(trl, name[len("FusedCE"):])
        except (ImportError, AttributeError):
            base = None
        if isinstance(base, type) and issubclass(base, TrainingArguments):
            return fused_ce_config(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class FusedCECallback(TrainerCallback):
    """Applies :func:`~fused_ce_patch.apply_fused_ce` to the Trainer's model at ``on_init_end``.

    Args:
        enabled: force on/off; None reads ``args.use_fused_ce`` and counts arguments without
            that field (plain ``TrainingArguments``, TRL's ``SFTConfig``) as on.
        backend: overrides ``args.fused_ce_backend`` (default ``"auto"``).
        logits_budget: overrides ``args.fused_ce_logits_budget``.
        return_logits: overrides ``args.fused_ce_return_logits``.

    ``on_train_begin`` checks again and patches (with a warning) if the model was unpatched
    in between; accelerate's prepared forward is then rebuilt around the patch. The Trainer
    that runs the callback gets a per-instance ``prediction_step`` that passes
    ``skip_logits=True`` when only the loss is needed (evaluation without logits).
    """

    def __init__(
        self,
        *,
        enabled: bool | None = None,
        backend: BackendName | None = None,
        logits_budget: int | None = None,
        return_logits: bool | None = None,
    ) -> None:
        self.enabled = enabled
        self.backend = backend
        self.logits_budget = logits_budget
        self.return_logits = return_logits

    def _is_enabled(self, args) -> bool:
        if self.enabled is not None:
            return bool(self.enabled)
        return bool(getattr(args, "use_fused_ce", True))

    def _options(self, args) -> dict:
        def pick(mine, name, default):
            return mine if mine is not None else getattr(args, name, default)

        return {
            "backend": pick(self.backend, "fused_ce_backend", "auto"),
            "logits_budget": pick(self.logits_budget, "fused_ce_logits_budget", None),
            "return_logits": pick(self.return_logits, "fused_ce_return_logits", False),
        }

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is None or not self._is_enabled(args):
            return
        _check_liger(args)
        options = self._options(args)
        refusal = _refusal(model)
        if refusal is not None:
            # As Trainer's use_liger_kernel and AutoFusedCEForCausalLM do: say so, train stock.
            logger.warning("fused_ce_patch: use_fused_ce is on but %s; training it unpatched",
                           refusal)
            return
        trainer = _calling_trainer(depth=6)
        before = None
        if trainer is not None and "trl" in sys.modules and not options["return_logits"] \
                and not is_fused_ce_applied(model):
            from .trl import convert_nll_sft_trainer

            before = convert_nll_sft_trainer(trainer, unwrap_causal_lm(model))
        apply_fused_ce(model, **options)
        if before is not None:
            # revert gives back the forward from before TRL's chunked head went on
            unwrap_causal_lm(model).__dict__[STATE_ATTR].previous = before
        if trainer is not None:
            if not getattr(args, "fused_ce_trust_compute_loss", False):
                _guard_custom_compute_loss(trainer)
            _install_prediction_step(trainer)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self._is_enabled(args) and not is_fused_ce_applied(model) \
                and _refusal(model) is None:
            logger.warning(
                "fused_ce_patch: the model was not patched at train begin; patching it now"
            )
            apply_fused_ce(model, **self._options(args))


def _refusal(model) -> str | None:
    """Why ``apply_fused_ce`` would refuse ``model`` (a short reason), or None."""
    from ..errors import UnsupportedModelError
    from .head import check_head
    from .patch import instance_spec, output_embeddings, prove_instance

    target = unwrap_causal_lm(model)
    if not callable(getattr(target, "get_output_embeddings", None)):
        return (f"{type(target).__name__} has no vocabulary head (lm_head), so there is no "
                f"causal-LM loss to fuse")
    try:
        head = output_embeddings(target)
    except UnsupportedModelError as exc:
        return str(exc).removeprefix("fused_ce_patch cannot patch ")[:300]
    if head is None:
        return (f"{type(target).__name__} has no vocabulary head (lm_head), so there is no "
                f"causal-LM loss to fuse")
    try:
        # apply_fused_ce's own spec (a transform head's forwards included), so that the proof
        # run here is the one apply_fused_ce then finds in the memo
        found = instance_spec(target)
        prove_instance(target, found)
        # and its head check (hooks, a Linear subclass, a replaced F.linear, ...)
        check_head(found.head, "lm_head" if found.path is None else found.path.names[-1])
    except UnsupportedModelError as exc:
        return f"{type(target).__name__} is not supported ({str(exc).split('; ')[0][:300]})"
    return None


def _check_liger(args) -> None:
    """Liger's fused linear cross-entropy replaces the same forward at ``train()``."""
    if not getattr(args, "use_liger_kernel", False):
        return
    config = getattr(args, "liger_kernel_config", None) or {}
    if config.get("fused_linear_cross_entropy", True):
        raise ValueError(
            "use_fused_ce and Liger Kernel's fused linear cross-entropy (use_liger_kernel=True) "
            "both replace the model's loss; keep Liger's other kernels with "
            "liger_kernel_config={'fused_linear_cross_entropy': False}, or drop one of the two."
        )


def _takes_skip_logits(model) -> bool:
    """Whether ``model``'s forward with labels reaches our patched forward (which pops
    ``skip_logits``) rather than a forward that would reject the keyword."""
    from .forward import STATE_ATTR
    from .patch import _is_trl_head

    target = unwrap_causal_lm(model)
    state = target.__dict__.get(STATE_ATTR)
    return state is not None and not _is_trl_head(state.installed) \
        and not state.options.return_logits


def _install_prediction_step(trainer) -> None:
    """Per-instance ``prediction_step`` that asks for the loss only when that is all it needs.

    Trainer's own ``prediction_step`` passes ``skip_logits=True`` only for Liger; TRL >= 1.15
    overrides ``prediction_step`` with its fused head (routed to us), so it is left alone.
    """
    if "prediction_step" in trainer.__dict__ or type(trainer).prediction_step is not \
            Trainer.prediction_step:
        return
    original = trainer.prediction_step
    trainer_ref = weakref.ref(trainer)

    @functools.wraps(original)
    def prediction_step(model, inputs, prediction_loss_only, ignore_keys=None):
        owner = trainer_ref()
        # Only with labels: the stock forward computes no loss from shift_labels alone (and
        # skip_logits=True without labels is an error). Only with the stock compute_loss: a
        # subclass's may read outputs.logits.
        if (prediction_loss_only and owner is not None and not owner.args.use_liger_kernel
                and "skip_logits" not in inputs and owner.label_smoother is None
                and owner.compute_loss_func is None and _takes_skip_logits(model)
                and inputs.get("labels") is not None
                and (_custom_compute_loss(owner) is None
                     or getattr(owner.args, "fused_ce_trust_compute_loss", False))):
            inputs = {**inputs, "skip_logits": True}
        return original(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    trainer.prediction_step = prediction_step


_GUARD = "_fused_ce_compute_loss_guard"


def _custom_compute_loss(trainer) -> str | None:
    """The qualified name of ``trainer``'s ``compute_loss`` when it is neither Trainer's own
    nor a TRL trainer's (whose heads hf/trl.py routes), else None.

    Such a method may read ``outputs.logits`` or pop the labels and compute its own loss; the
    flag cannot tell that it computes the stock loss."""
    def trusted(fn) -> bool:
        # Trainer's, TRL's (hf/trl.py's per-instance wrapper of an SFTTrainer's copies its
        # module), or our own guard
        module = getattr(fn, "__module__", "") or ""
        return fn is Trainer.compute_loss or getattr(fn, "__func__", None) is \
            Trainer.compute_loss or getattr(fn, _GUARD, False) or module == "trl" or \
            module.startswith(("trl.", "fused_ce_patch."))

    own = trainer.__dict__.get("compute_loss")
    if own is not None and not trusted(own):
        return getattr(own, "__qualname__", repr(own))
    func = getattr(type(trainer), "compute_loss", None)
    return None if trusted(func) else getattr(func, "__qualname__", repr(func))


def _guard_custom_compute_loss(trainer) -> None:
    """Run a subclass's own ``compute_loss`` on the stock path (real logits), per instance.

    Trainer subclasses that override ``compute_loss`` commonly read ``outputs.logits`` (a
    penalty, a distillation term) or pop the labels and weight the per-token loss; the fused
    path would hand them a placeholder. Inside their call every patched forward runs as stock
    (:func:`~.forward.stock_path`), so training and evaluation give stock's numbers; one
    warning says the memory saving is off for this trainer.
    """
    from .forward import stock_path

    name = _custom_compute_loss(trainer)
    if name is None or getattr(trainer.__dict__.get("compute_loss"), _GUARD, False):
        return
    original = trainer.compute_loss

    @functools.wraps(original)
    def compute_loss(*args, **kwargs):
        with stock_path():
            return original(*args, **kwargs)

    setattr(compute_loss, _GUARD, True)
    trainer.compute_loss = compute_loss
    logger.warning(
        "fused_ce_patch: %s overrides compute_loss (%s), which may read outputs.logits or "
        "compute its own loss; its calls run the model's stock forward (real logits, no "
        "memory saving). If it reads only outputs.loss (e.g. it calls super().compute_loss), "
        "pass fused_ce_trust_compute_loss=True to keep the fused loss.",
        type(trainer).__name__, name)

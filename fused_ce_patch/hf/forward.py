"""The one causal-LM forward shared by every supported architecture.

:func:`patched_forward` wraps an architecture's own ``forward`` (the "stock" forward). On each
call it either hands the call to the stock forward unchanged, or runs the fused path: the
class's stock forward as rewritten by :mod:`.architectures` — the stock code statement for
statement (decoder call with every argument passed through, ``logits_to_keep`` slicing, MoE
router aux loss, output class and fields), except that

1. ``logits = self.lm_head(hidden)`` keeps the operands (:class:`DeferredLogits`) instead of
   computing logits;
2. each logit-transform statement (multiplier, divisor, final-logit softcap) is recorded on it;
3. ``self.loss_function(logits, labels, vocab_size, **kwargs)`` becomes
   :func:`fused_head_loss`: :func:`~fused_ce_patch.fused_linear_cross_entropy` from the hidden
   states and the head operands (:mod:`.head`), honouring ``num_items_in_batch`` /
   ``ignore_index`` / ``shift_labels`` exactly as ``ForCausalLMLoss`` does;
4. ``logits`` is then a :class:`~fused_ce_patch.hf.sentinel.NotMaterializedLogits`.

The fused path runs when labels (or ``shift_labels``) are given, the model is training, autograd
is on, the model's loss is transformers' causal-LM loss, and neither ``return_logits=True`` nor
``$FUSED_CE_RETURN_LOGITS`` asks for logits. ``skip_logits`` (the Trainer/TRL/Liger convention)
overrides the mode test: ``True`` takes the fused path whenever labels are given, ``False``
never. Source: transformers ``ForCausalLMLoss`` (``loss/loss_utils.py``, 5.17, 5.24) for the
loss semantics; Liger Kernel ``lce_forward`` for the ``skip_logits`` convention.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import os

import torch

from .architectures import ArchSpec
from .head import fused_head_loss as _head_loss
from .head import head_operands
from .loss_mapping import is_causal_lm_loss
from .sentinel import RETURN_LOGITS_ENV, NotMaterializedLogits

#: Instance attribute holding an instance patch's state (options, forward it replaced).
STATE_ATTR = "_fused_ce_state"

_FALSY = ("", "0", "false", "no", "off")


@dataclasses.dataclass
class FusedCEOptions:
    """Options of one patch (instance or class).

    Attributes:
        backend: ``fused_linear_cross_entropy`` backend (``"auto"``, ``"torch"``, ...).
        logits_budget: bytes of transient logits one chunk may hold; None = backend default.
        return_logits: always take the stock path (real logits, no memory saving).
    """

    backend: str = "auto"
    logits_budget: int | None = None
    return_logits: bool = False


class _ClassSlot:
    """Options of a class-level patch of one stock forward (None while not class-patched)."""

    __slots__ = ("options",)

    def __init__(self):
        self.options = None


# stock forward -> (patched forward, class slot); and patched forward -> stock forward
_PATCHED: dict = {}
_STOCK: dict = {}


def return_logits_from_env() -> bool:
    """``$FUSED_CE_RETURN_LOGITS`` set to anything but ``"" / 0 / false / no / off``."""
    return os.environ.get(RETURN_LOGITS_ENV, "").strip().lower() not in _FALSY


def is_patched_forward(fn) -> bool:
    return fn in _STOCK


def stock_forward_of(fn):
    """The stock forward behind a patched forward (``fn`` itself when not patched)."""
    return _STOCK.get(fn, fn)


def class_slot(stock) -> _ClassSlot:
    return _PATCHED[stock][1]


def patched_forward(stock, spec: ArchSpec):
    """The patched forward for the stock forward ``stock`` (one function per stock forward).

    ``functools.wraps`` keeps the stock name, docstring and signature (``__wrapped__``), so
    ``generate()`` (``logits_to_keep`` detection, kwarg validation) and Trainer (column
    filtering, ``**kwargs`` detection for ``num_items_in_batch``) inspect what they expect.
    """
    if stock in _PATCHED:
        return _PATCHED[stock][0]
    slot = _ClassSlot()
    signature = inspect.signature(stock)
    var_kw = next(
        (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
    )

    @functools.wraps(stock)
    def forward(self, *args, **kwargs):
        state = self.__dict__.get(STATE_ATTR)
        options = state.options if state is not None else slot.options
        if options is None:  # reverted: behave exactly as the stock forward
            return stock(self, *args, **kwargs)
        skip_logits = kwargs.pop("skip_logits", None)
        if skip_logits is False or options.return_logits or return_logits_from_env():
            return stock(self, *args, **kwargs)
        if skip_logits is None and not (self.training and torch.is_grad_enabled()):
            return stock(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        extra = arguments.get(var_kw) or {} if var_kw else {}
        has_labels = arguments.get("labels") is not None or extra.get("shift_labels") is not None
        if not has_labels:
            if skip_logits:
                raise ValueError("skip_logits=True needs labels or shift_labels")
            return stock(self, *args, **kwargs)
        if not is_causal_lm_loss(self.loss_function):  # a custom loss needs real logits
            return stock(self, *args, **kwargs)
        if arguments.get("labels") is None:
            # shift_labels alone: ForCausalLMLoss ignores labels when shift_labels is given,
            # but the stock forward only calls the loss when labels is not None.
            arguments["labels"] = extra["shift_labels"]
        token = _OPTIONS.set(options)
        try:
            return spec.rewritten(*bound.args, **bound.kwargs)
        finally:
            _OPTIONS.reset(token)

    _PATCHED[stock] = (forward, slot)
    _STOCK[forward] = stock
    return forward


# -- what the rewritten forward calls in place of head, transform and loss -------------------

_OPTIONS: contextvars.ContextVar = contextvars.ContextVar("fused_ce_options", default=None)


class DeferredLogits:
    """What ``logits = self.lm_head(hidden)`` yields in a rewritten forward: the operands only.

    Attributes:
        hidden: the (already ``logits_to_keep``-sliced) hidden states ``[..., H]``.
        head: the head module (checked to be ``get_output_embeddings()``).
        scale: product of the multipliers / reciprocal divisors seen so far (None: 1).
        softcap: final-logit softcap ``c`` (None: off).
    """

    __slots__ = ("hidden", "head", "scale", "softcap", "options")

    def __init__(self, hidden, head, options):
        self.hidden, self.head, self.options = hidden, head, options
        self.scale, self.softcap = None, None

    def __repr__(self):
        return f"DeferredLogits(hidden={tuple(self.hidden.shape)}, scale={self.scale}, " \
               f"softcap={self.softcap})"


def _defer(model, head, hidden):
    options = _OPTIONS.get()
    if options is None:  # only the patched forward calls the rewritten one
        raise RuntimeError("fused_ce_patch: rewritten forward called outside the patch")
    if head is not model.get_output_embeddings():
        raise RuntimeError(
            f"fused_ce_patch: {type(model).__name__} calls a head that is not "
            f"get_output_embeddings(); cannot take the fused path"
        )
    return DeferredLogits(hidden, head, options)


def _transform(logits: DeferredLogits, kind: str, value, optional: bool):
    if optional and not value:  # `if config.final_logit_softcapping is not None:` was false
        return logits
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"fused_ce_patch: logit {kind} must be a scalar, got {value.shape}")
        value = value.item()
    value = float(value)
    if kind == "softcap":
        logits.softcap = value
        return logits
    if logits.softcap is not None:
        raise ValueError("fused_ce_patch: a logit scale after the softcap is not supported")
    factor = value if kind == "mul" else 1.0 / value
    logits.scale = factor if logits.scale is None else logits.scale * factor
    return logits


def _done(logits):
    if isinstance(logits, DeferredLogits):
        return NotMaterializedLogits((*logits.hidden.shape[:-1], logits.head.out_features
                                      if hasattr(logits.head, "out_features")
                                      else head_operands(logits.head, logits.hidden)[1].shape[0]))
    return logits


def fused_head_loss(
    logits: DeferredLogits,
    labels,
    vocab_size=None,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels=None,
    **kwargs,
):
    """Stands in for ``self.loss_function(logits, labels, vocab_size, **kwargs)``.

    Same arguments as transformers' ``ForCausalLMLoss``; computes the same loss with
    :func:`~fused_ce_patch.fused_linear_cross_entropy` from the deferred head operands.
    """
    hidden = logits.hidden
    if labels is None and shift_labels is None:
        raise ValueError("fused_ce_patch: the loss needs labels or shift_labels")
    if shift_labels is not None:  # already shifted by the caller: never shift again
        target, shift = shift_labels, False
    else:
        target, shift = labels, True
    h = hidden
    target = target.to(h.device)
    if target.shape != h.shape[:-1]:
        # ForCausalLMLoss only needs equal element counts (it flattens both), e.g. a boolean
        # logits_to_keep mask with flat labels: shift first, then match the hidden layout.
        if target.numel() != h.shape[:-1].numel():
            raise ValueError(
                f"labels {tuple(target.shape)} do not match the kept hidden states "
                f"{tuple(h.shape)}"
            )
        if shift:
            target, shift = _shift_left(target, ignore_index), False
        target = target.reshape(h.shape[:-1])
    options = logits.options
    # The one place the head is computed: inside its owning module's call where a wrapper
    # (FSDP, ZeRO-3) gathers the weight there, else from the weight directly (hf/head.py).
    loss, vocab = _head_loss(
        logits.head,
        h,
        target,
        logit_scale=logits.scale,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
        shift=shift,
        softcap=logits.softcap,
        logits_budget=options.logits_budget,
        backend=options.backend,
    )
    if vocab_size is not None and int(vocab_size) != vocab:
        raise ValueError(f"fused_ce_patch: vocab_size {vocab_size} != lm_head rows {vocab}")
    return loss


def _loss(*args, **kwargs):
    # Looked up at call time, so a spy on fused_head_loss (or hf.head) sees every call.
    return fused_head_loss(*args, **kwargs)


def rewrite_helpers() -> dict:
    """The names :mod:`.architectures` injects into a rewritten forward's globals."""
    from . import architectures as a

    return {a.DEFER: _defer, a.TRANSFORM: _transform, a.LOSS: _loss, a.DONE: _done}


def _shift_left(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)

"""The one causal-LM forward shared by every supported architecture.

:func:`patched_forward` wraps an architecture's own ``forward`` (the "stock" forward). On each
call it either hands the call to the stock forward unchanged, or runs the fused path:

1. bind the call to the stock signature and pass every decoder argument through unchanged
   (``cache`` on transformers >= 5.2x, ``past_key_values`` before, and ``**kwargs``) to the
   decoder;
2. slice the last hidden states by ``logits_to_keep`` exactly as the stock forward does;
3. compute the loss with :func:`~fused_ce_patch.fused_linear_cross_entropy` from the hidden
   states and the head operands (:mod:`.head`), with the architecture's softcap / logit scale
   (:mod:`.architectures`) and ``num_items_in_batch`` / ``ignore_index`` / ``shift_labels`` from
   the loss kwargs;
4. return the stock output class built from the decoder's own output fields, with a
   :class:`~fused_ce_patch.hf.sentinel.NotMaterializedLogits` in ``logits``.

The fused path runs when labels (or ``shift_labels``) are given, the model is training, autograd
is on, the model's loss is transformers' causal-LM loss, and neither ``return_logits=True`` nor
``$FUSED_CE_RETURN_LOGITS`` asks for logits. ``skip_logits`` (the Trainer/TRL/Liger convention)
overrides the mode test: ``True`` takes the fused path whenever labels are given, ``False``
never. Source: transformers ``LlamaForCausalLM.forward`` (5.17, 5.24) for the stock head; Liger
Kernel ``lce_forward`` for the ``skip_logits`` convention.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os

import torch

from .architectures import ArchSpec
from .head import fused_head_loss
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
        arguments = signature.bind(self, *args, **kwargs).arguments
        extra = dict(arguments.pop(var_kw, None) or {}) if var_kw else {}
        has_labels = arguments.get("labels") is not None or extra.get("shift_labels") is not None
        if not has_labels:
            if skip_logits:
                raise ValueError("skip_logits=True needs labels or shift_labels")
            return stock(self, *args, **kwargs)
        if not is_causal_lm_loss(self.loss_function):  # a custom loss needs real logits
            return stock(self, *args, **kwargs)
        arguments.pop(next(iter(signature.parameters)))  # self
        return _fused_forward(self, spec, options, arguments, extra)

    _PATCHED[stock] = (forward, slot)
    _STOCK[forward] = stock
    return forward


def _inline_slice(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    # transformers 5.17-5.20 inline this in every forward (int or index tensor).
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, keep, :]


@functools.lru_cache(maxsize=None)
def _slicer():
    try:  # transformers >= 5.21 (adds 2-D index and boolean-mask forms)
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        return _inline_slice
    return slice_logits_to_keep


def _slice_hidden(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """What the stock forward does to the hidden states before ``lm_head``."""
    return _slicer()(hidden, logits_to_keep)


def _shift_left(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def _fused_forward(model, spec: ArchSpec, options: FusedCEOptions, arguments: dict, extra: dict):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # What transformers' can_return_tuple does around every stock forward.
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)

    labels = arguments.pop("labels", None)
    logits_to_keep = arguments.pop("logits_to_keep", 0)
    for name in spec.head_params:
        arguments.pop(name, None)
    decoder = getattr(model, spec.decoder_attr)
    outputs = decoder(**arguments, **extra)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    hidden = _slice_hidden(hidden, logits_to_keep)

    ignore_index = extra.get("ignore_index", -100)
    shift_labels = extra.get("shift_labels")
    if shift_labels is not None:  # already shifted by the caller: never shift again
        target, shift = shift_labels, False
    else:
        target, shift = labels, True
    h = hidden
    if target.shape != h.shape[:-1]:
        # ForCausalLMLoss only needs equal element counts (it flattens both), e.g. a boolean
        # logits_to_keep mask with flat labels: shift first, then match the hidden layout.
        if target.numel() != h.shape[:-1].numel():
            raise ValueError(
                f"labels {tuple(target.shape)} do not match the kept hidden states "
                f"{tuple(h.shape)} (logits_to_keep={logits_to_keep!r})"
            )
        if shift:
            target, shift = _shift_left(target, ignore_index), False
        target = target.reshape(h.shape[:-1])

    loss, vocab = fused_head_loss(
        model.get_output_embeddings(),
        h,
        target,
        logit_scale=spec.logit_scale(model.config),
        ignore_index=ignore_index,
        num_items_in_batch=extra.get("num_items_in_batch"),
        shift=shift,
        softcap=spec.softcap(model.config),
        logits_budget=options.logits_budget,
        backend=options.backend,
    )
    fields = {
        f.name: getattr(outputs, f.name, None)
        for f in dataclasses.fields(CausalLMOutputWithPast)
        if f.name not in ("loss", "logits")
    }
    logits = NotMaterializedLogits((*hidden.shape[:-1], vocab))
    output = CausalLMOutputWithPast(loss=loss, logits=logits, **fields)
    return output if return_dict else output.to_tuple()

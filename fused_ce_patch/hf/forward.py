"""The one causal-LM forward shared by every supported architecture.

:func:`patched_forward` wraps an architecture's own ``forward`` (the "stock" forward). On each
call it either hands the call to the stock forward unchanged, or runs the fused path: the
class's stock forward as rewritten by :mod:`.architectures` — the stock code statement for
statement, run with the modeling module's live globals and inside copies of the stock
forward's own wrapper layers (decoder call with every argument passed through,
``logits_to_keep`` slicing, MoE router aux loss, output class and fields), except that

1. ``logits = self.lm_head(hidden)`` keeps the operands (:class:`DeferredLogits`) instead of
   computing logits; a head module with a transform before ``get_output_embeddings()``
   (RoBERTa, BERT) runs its own code up to that projection, whose input becomes the hidden
   states (:mod:`.head_path`);
2. each logit-transform statement (multiplier, divisor, final-logit softcap, ``.float()``) is
   recorded on it;
3. ``self.loss_function(logits, labels, vocab_size, **kwargs)`` becomes
   :func:`fused_head_loss`: :func:`~fused_ce_patch.fused_linear_cross_entropy` from the hidden
   states and the head operands (:mod:`.head`), honouring ``num_items_in_batch`` /
   ``ignore_index`` / ``shift_labels`` exactly as ``ForCausalLMLoss`` does; in the
   ``CrossEntropyLoss`` form (BART family, Whisper, ...) ``loss_fct(logits.view(-1, V),
   labels.view(-1))`` becomes :func:`fused_module_ce_loss` (unshifted mean, stock's dtype), and
   an extra term's ``logits.logsumexp(dim=-1)`` (Bamba's z-loss) is computed without logits
   (:meth:`DeferredLogits.logsumexp`);
4. ``logits`` is then a :class:`~fused_ce_patch.hf.sentinel.NotMaterializedLogits`.

The fused path runs when ``labels`` are given, the model is training, autograd is on, and
neither ``return_logits=True`` nor ``$FUSED_CE_RETURN_LOGITS`` asks for logits — and only while
it computes what the live stock forward would compute at that call (design.md §5, "the live
model is the reference"):

- the loss in force (the model's own ``loss_function``, else ``LOSS_MAPPING[loss_type]``) is
  the ``ForCausalLMLoss`` that was proven (:func:`~.loss_mapping.fused_loss_refusal`);
- for an instance patch, the class's ``forward`` is still the one the instance was patched
  against (a class forward wrapped or replaced later runs as stock);
- a logit-transform operand that requires grad (a trainable ``logit_scale``) gets its exact
  gradient: multipliers and divisors are folded into the hidden states as tensors;
- what only the call shows — a trainable or non-positive softcap, a non-scalar or zero
  operand, a head hooked or replaced after the patch (backward and process-wide module hooks
  included), a replaced ``torch.tanh`` under a softcap, labels other than int64, a
  ``vocab_size`` other than the head's, mixed dtypes, an odd ``num_items_in_batch``, a functorch
  transform or forward-mode AD — makes the call materialise the logits (:func:`materialize`:
  the stock computation from the head call on, the decoder not run twice; :func:`_loss_refusal`).

Otherwise the call runs the stock forward, with one warning per class and reason.
``skip_logits`` (the Trainer/TRL/Liger convention) overrides the mode test: ``True`` takes the
fused path whenever labels are given, ``False`` never. Source: transformers ``ForCausalLMLoss``
(``loss/loss_utils.py``, 5.17, 5.24) for the loss semantics; Liger Kernel ``lce_forward`` for
the ``skip_logits`` convention.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import numbers
import os
import warnings

import torch

from .. import errors as _errors
from ..errors import UnsupportedModelError
from .architectures import CE, DEFER, DONE, LOSS, MATERIALIZE, TRANSFORM, ArchSpec
from .head import (check_head, fp32_output_head, fused_head_lse, head_operands, parametrized,
                   parametrized_anywhere)
from .head import fused_head_loss as _head_loss
from .head_path import resolve
from .loss_mapping import forward_ad_dual, forward_ad_open, functorch_active, fused_loss_refusal
from .registry import PATCHED as _PATCHED
from .registry import STOCK as _STOCK
from .registry import stock_forward_of, wraps_patched
from .sentinel import RETURN_LOGITS_ENV, NotMaterializedLogits
from .softcap_call import callable_softcap

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


_WARNED: set = set()


def return_logits_from_env() -> bool:
    """``$FUSED_CE_RETURN_LOGITS`` set to anything but ``"" / 0 / false / no / off``."""
    raw = os.environ.get(RETURN_LOGITS_ENV, "")
    return bool(raw) and raw.strip().lower() not in _FALSY  # unset: no string work


#: Set while a caller that may read ``outputs.logits`` runs (a Trainer subclass's own
#: ``compute_loss`` under the flag): every patched forward in that context runs as stock.
_STOCK_PATH: contextvars.ContextVar = contextvars.ContextVar("fused_ce_stock_path",
                                                            default=False)


class _StockPathDepth:
    """How many :func:`stock_path` blocks are open in the process. Dynamo cannot trace
    ``ContextVar.get`` (a graph break at the top of every compiled forward), but it reads and
    guards a plain attribute: a traced forward reads this, and a compiled model entering or
    leaving such a block is recompiled (process-wide rather than per thread, under compile
    only)."""

    open = 0


_STOCK_PATH_DEPTH = _StockPathDepth()


@contextlib.contextmanager
def stock_path():
    """Within the block (this thread / task only; under ``torch.compile``, the process),
    patched forwards run their stock forward: real logits, the stock loss. Used by the Trainer
    flag around a ``compute_loss`` it cannot tell is the stock one."""
    token = _STOCK_PATH.set(True)
    _STOCK_PATH_DEPTH.open += 1
    try:
        yield
    finally:
        _STOCK_PATH_DEPTH.open -= 1
        _STOCK_PATH.reset(token)


def _on_stock_path() -> bool:
    if torch.compiler.is_compiling():
        return _STOCK_PATH_DEPTH.open > 0
    return _STOCK_PATH.get()


def class_slot(stock) -> _ClassSlot:
    return _PATCHED[stock][1]


def class_forward(cls: type):
    """``cls.forward`` as the class defines it now, a class patch of ours looked through."""
    for klass in cls.__mro__:
        if "forward" in klass.__dict__:
            return stock_forward_of(klass.__dict__["forward"])
    return None


def warn_stock_path(model, reason: str) -> None:
    """One ``RuntimeWarning`` per (class, reason) and process: this call runs as stock.

    Not while the proof runs its copies of the model (:func:`~.proof.proving`): the warning is
    kept for the user's own call."""
    from .proof import proving

    key = (type(model).__qualname__, reason)
    if key in _WARNED or proving():
        return
    _WARNED.add(key)
    warnings.warn(
        f"fused_ce_patch: {type(model).__name__} runs its stock forward (real logits, no memory "
        f"saving) because {reason}.", RuntimeWarning, stacklevel=3,
    )


def keyword_labels_bind(signature: inspect.Signature) -> bool:
    """Whether ``signature.bind(self, **kwargs).arguments.get("labels")`` is
    ``kwargs.get("labels")`` for every ``kwargs`` a method's ``(self, *args, **kwargs)`` wrapper
    can receive with ``args`` empty: the first parameter is ``self`` (never a keyword there),
    every other one has a default or is variadic, a ``**`` parameter takes any other name, and
    ``labels`` is a named parameter that may be passed by keyword. Then ``bind`` (microseconds
    per call) cannot fail and binds ``labels`` to that keyword's value or not at all."""
    params = list(signature.parameters.values())
    if not params or params[0].name != "self" or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return False
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    labels = signature.parameters.get("labels")
    return (all(p.default is not inspect.Parameter.empty or p.kind in variadic
                for p in params[1:])
            and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
            and labels is not None and labels is not params[0] and labels.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


def patched_forward(stock, spec: ArchSpec):
    """The patched forward for the stock forward ``stock`` (one function per stock forward).

    ``functools.wraps`` keeps the stock name and docstring and ``__signature__`` the stock
    signature, so ``generate()`` (``logits_to_keep`` detection, kwarg validation) and Trainer
    (column filtering, ``**kwargs`` detection for ``num_items_in_batch``) inspect what they
    expect; there is no ``__wrapped__`` link to the stock forward (the registry maps one to
    the other), so unwrapping down ``__wrapped__`` chains stops at the patched forward.
    """
    if stock in _PATCHED:
        return _PATCHED[stock][0]
    slot = _ClassSlot()
    signature = inspect.signature(stock)
    keyword_labels = keyword_labels_bind(signature)
    rewritten = spec.build(_helpers(slot, lse_terms=bool(spec.extra_terms)))

    @functools.wraps(stock)
    def forward(self, *args, **kwargs):
        skip_logits = kwargs.pop("skip_logits", None)  # ours (Trainer/TRL): never the stock's
        state = self.__dict__.get(STATE_ATTR)
        if state is not None:
            # An instance patch shadows the class attribute: if the class's forward changed
            # since (wrapped, replaced), the stock model would run the new one.
            live = class_forward(type(self))
            if live is not stock and not wraps_patched(live):
                warn_stock_path(self, "its class's forward changed after apply_fused_ce "
                                      "(apply_fused_ce(model) again to patch the new one)")
                return live(self, *args, **kwargs)
        options = state.options if state is not None else slot.options
        if options is None:  # reverted: behave exactly as the stock forward
            return stock(self, *args, **kwargs)
        if skip_logits is False or options.return_logits or return_logits_from_env() \
                or _on_stock_path():
            return stock(self, *args, **kwargs)
        if skip_logits is None and not (self.training and torch.is_grad_enabled()):
            return stock(self, *args, **kwargs)
        labels = kwargs.get("labels") if keyword_labels and not args else \
            signature.bind(self, *args, **kwargs).arguments.get("labels")
        if labels is None:
            # The stock forward computes a loss only when labels is given (shift_labels alone
            # gives loss=None there too).
            if skip_logits:
                raise ValueError("skip_logits=True needs labels")
            return stock(self, *args, **kwargs)
        # The CrossEntropyLoss form never calls the model's loss_function: its module is
        # checked at the call instead (_ce_refusal).
        reason = fused_loss_refusal(self) if spec.loss_form != "cross_entropy" else None
        if reason is not None:  # a custom or replaced loss needs real logits
            warn_stock_path(self, reason)
            return stock(self, *args, **kwargs)
        return rewritten(self, *args, **kwargs)

    # Not a __wrapped__ link to stock: accelerate's unwrap_model(keep_fp32_wrapper=False)
    # walks __wrapped__ to the innermost function and binds that, which would drop the patch.
    # The signature stays the stock one (generate() and Trainer inspect it).
    del forward.__wrapped__
    forward.__signature__ = signature
    _PATCHED[stock] = (forward, slot)
    _STOCK[forward] = stock
    return forward


# -- what the rewritten forward calls in place of head, transform and loss -------------------


class DeferredLogits:
    """What ``logits = self.lm_head(hidden)`` yields in a rewritten forward: the operands only.

    Attributes:
        model: the causal LM whose forward is running.
        hidden: the (already ``logits_to_keep``-sliced) hidden states ``[..., H]``; for a
            head module with a transform before the projection, the projection's input.
        head: ``get_output_embeddings()``, the projection (:mod:`.head_path`).
        scale: product of the multipliers / reciprocal divisors seen so far: None (1), a
            float, or a 0-d tensor when an operand requires grad.
        softcap: final-logit softcap ``c`` (None: off).
        ops: every transform as recorded, ``(kind, operand)``, to replay on real logits.
        real: the stock logits once this call materialised them (:func:`materialize`), else
            None.
        parent: ``(logits, key)`` when these are ``logits[key]``, positions selected and the
            vocabulary whole (:meth:`__getitem__`), else None.
    """

    __slots__ = ("model", "hidden", "head", "scale", "softcap", "options", "ops", "real",
                 "parent")

    def __init__(self, model, hidden, head, options):
        self.model, self.hidden, self.head, self.options = model, hidden, head, options
        self.scale, self.softcap, self.ops = None, None, []
        self.real = None  # the stock logits, once a call had to materialise them
        self.parent = None

    def __getitem__(self, key):
        """``logits[:, a:b, :]`` — positions selected by slices, the vocabulary whole — as the
        deferred logits of those positions (GIT drops its image positions before the loss);
        any other index, or any index of a head that draws dropout at each call (a LoRA head
        in training: stock draws its mask over every position), computes the real logits and
        indexes them as stock does."""
        if self.real is None and _positions_only(key, self.hidden.dim()):
            if not _draws_at_call(self.head):
                rows = DeferredLogits(self.model, self.hidden[key[:-1]], self.head, self.options)
                rows.scale, rows.softcap, rows.parent = self.scale, self.softcap, (self, key)
                return rows
            # stock draws the head's dropout over every position, then selects: a fused loss
            # over the selected rows would draw another mask
            materialize(self, "its forward selects positions of the logits of a head that "
                              "draws dropout or evaluates a parametrization at each call")
        if self.real is None:
            materialize(self, "its forward indexes the logits other than by positions")
        return self.real[key]

    def contiguous(self):
        """``logits[...].contiguous()``: the same deferred logits (the values are the same)."""
        return self

    @property
    def shape(self) -> torch.Size:
        """The stock logits' shape, ``[..., V]`` (a stock test such as ``logits.shape[1] > n``
        reads it without logits)."""
        return torch.Size((*self.hidden.shape[:-1], _vocab_rows(self.head, self.hidden)))

    def __repr__(self):
        return f"DeferredLogits(hidden={tuple(self.hidden.shape)}, scale={self.scale}, " \
               f"softcap={self.softcap})"

    @property
    def device(self) -> torch.device:
        """The device stock's logits would be on: the head weight's (``F.linear`` computes
        there), else the hidden states'. For ``labels = labels.to(logits.device)``."""
        if self.real is not None:
            return self.real.device
        if parametrized_anywhere(self.head):
            # reading the weight would evaluate its parametrization (stock: once, in the
            # head's call); the stored tensors sit where it computes
            weight = next(iter(self.head.parameters()), None)
        else:
            weight = getattr(self.head, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
            return weight.device
        return self.hidden.device

    def logsumexp(self, dim):
        """``logits.logsumexp(dim=-1)`` as stock computes it: ``[...]`` per kept position, in
        stock's logits dtype, with gradients to the hidden states and the head — without the
        logits (:func:`fused_head_lse`) where that is exact, else from real logits
        (:func:`materialize`). Used by extra loss terms after the loss call (Bamba's z-loss);
        ``dim`` other than the last materialises too."""
        if self.real is None:
            reason = _lse_refusal(self, dim)
            if reason is None:
                return _fused_lse(self)
            materialize(self, reason)
        return self.real.logsumexp(dim=dim)


def _helpers(slot, lse_terms: bool = False) -> dict:
    """The functions one patched forward's rewrite calls (closure variables of the rewrite).

    Options come from the model (its instance patch state) or this forward's class slot, not
    from a context variable, so ``torch.compile`` traces the call without a graph break.
    ``lse_terms``: the loss block has extra terms after the loss call (Bamba's z-loss), so the
    loss call first settles whether they will need real logits (:func:`_settle_for_lse`).
    """

    def defer(model, head, hidden_in):
        hidden = hidden_in
        state = model.__dict__.get(STATE_ATTR)
        options = state.options if state is not None else slot.options
        if options is None:  # only the patched forward calls the rewritten one
            raise RuntimeError("fused_ce_patch: rewritten forward called outside the patch")
        try:
            projection = model.get_output_embeddings()
        except Exception as exc:  # noqa: BLE001 - stock's forward never calls it
            # e.g. RoBERTa's reads self.lm_head.decoder, gone once lm_head was replaced by a
            # plain module: the stock head call, as the stock forward makes it
            warn_stock_path(model, f"its get_output_embeddings() raises "
                                   f"{type(exc).__name__}: {str(exc)[:80]}")
            return head(hidden_in)
        if head is not projection:
            # A head module with a transform before the projection (RoBERTa, BERT): the fused
            # loss takes the projection's input, computed by the head's own code (.head_path).
            hidden = _projection_input(model, head, projection, hidden, state)
            if hidden is None:
                return head(hidden_in)
            head = projection
        return DeferredLogits(model, hidden, head, options)

    # Looked up at call time, so a spy on this module's functions sees every call.
    return {
        DEFER: defer,
        TRANSFORM: lambda *args: _transform(*args),
        LOSS: lambda *args, **kwargs: _loss(*args, **kwargs) if not lse_terms else (
            _settle_for_lse(args[1] if len(args) > 1 else kwargs.get("logits")),
            _loss(*args, **kwargs))[1],
        DONE: lambda logits: _done(logits),
        MATERIALIZE: lambda logits, reason: _real(logits, reason),
        CE: lambda *args: _ce(*args) if not lse_terms else (_settle_for_lse(args[2]),
                                                             _ce(*args))[1],
    }


def _settle_for_lse(logits) -> None:
    """Materialise ``logits`` (the loss call's deferred logits) now when an extra loss term
    after this loss call could take their log-sum-exp only from a second call of the head
    that may not give the same logits: stock calls the head once, so the loss and the term
    see one dropout draw (a LoRA adapter's ``lora_dropout`` in training) or one evaluation of
    a parametrization. A head the fused log-sum-exp cannot read that has neither (LoRA without
    dropout, in eval) keeps the fused loss; the term then calls it again, to the same logits."""
    if isinstance(logits, DeferredLogits) and logits.real is None:
        head = logits.head
        if isinstance(head, torch.nn.Linear) and not parametrized_anywhere(head):
            return  # read directly by the fused log-sum-exp: no second head call
        if _draws_at_call(head):
            materialize(logits, f"an extra loss term takes the log-sum-exp of its logits, "
                                f"and its lm_head ({type(head).__qualname__}) draws dropout "
                                f"or evaluates a parametrization at each call")


def _draws_at_call(head) -> bool:
    """Whether calling ``head`` may give other logits each time, or depend on the shape of its
    input: a dropout module active in training (a LoRA adapter's ``lora_dropout``) or a
    parametrization anywhere in it."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0
               or torch.nn.utils.parametrize.is_parametrized(m) for m in head.modules())


def _positions_only(key, dims: int) -> bool:
    """``key`` is a tuple of ``dims`` plain slices, the last one ``:`` (the whole vocabulary)."""
    return (isinstance(key, tuple) and len(key) == dims and all(
        isinstance(k, slice) and all(v is None or (isinstance(v, int) and not isinstance(v, bool))
                                     for v in (k.start, k.stop, k.step)) for k in key)
            and key[-1] == slice(None) and all(k.step in (None, 1) for k in key))


def _projection_input(model, head, projection, hidden, state):
    """``hidden`` through ``head``'s code up to ``projection`` (:mod:`.head_path`), or None
    (after one warning) when this call must run the stock head call instead: ``projection``
    is not inside ``head`` (e.g. ``get_output_embeddings`` replaced on the instance), a module
    on the way is hooked or its forward replaced, or, for an instance patch, a class forward on
    the way is not the one analysed when the model was patched."""
    path = _head_path_now(model, head, projection, getattr(state, "head_forwards", None))
    if path is None:
        return None
    return path.prefix(head, hidden)  # the head's own code: traced by torch.compile


@torch.compiler.disable
def _head_path_now(model, head, projection, recorded):
    # Reads sources and module state (an eager graph break under torch.compile, not traced).
    if not isinstance(head, torch.nn.Module) or not any(m is projection for m in head.modules()):
        warn_stock_path(model, "the head its forward calls is not get_output_embeddings()")
        return None
    name = next((n for n, m in model.named_children() if m is head), type(head).__name__)
    path = resolve(head, projection, name)
    if isinstance(path, str):
        reason = path
    elif recorded is not None and path.forwards != recorded:
        changed = [f for f, g in zip(path.forwards, recorded) if f is not g]
        what = changed[0].__qualname__ if changed else "a module's forward"
        reason = (f"{what} on the way from its head module to get_output_embeddings() is not "
                  f"the one analysed by apply_fused_ce")
    else:
        return path
    warn_stock_path(model, f"its head call cannot be split into a transform and "
                           f"get_output_embeddings() now: {reason}")
    return None


def _real(logits, reason: str):
    """The real logits where the stock code runs a branch the rewrite does not express."""
    if isinstance(logits, DeferredLogits):
        return materialize(logits, reason)
    return logits


def _apply_op(logits: torch.Tensor, kind: str, value):
    """One recorded transform on real logits, written as the stock statements are."""
    if kind == "mul":
        return logits * value
    if kind == "div":
        return logits / value
    if kind == "softcap":
        logits = logits / value
        logits = torch.tanh(logits)
        return logits * value
    if kind == "capcall":
        return value(logits)
    if kind == "capfn":
        return value[0](logits, value[1])
    return logits.float()  # "float"


def materialize(logits: DeferredLogits, reason: str) -> torch.Tensor:
    """The stock logits for this call: the head module called on the hidden states, then every
    recorded transform statement as the stock code writes it. The rewritten forward carries on
    with them (stock loss, real ``outputs.logits``): the stock computation from the head call
    on, without running the decoder twice. Warns once per class and reason."""
    if logits.real is None:
        warn_stock_path(logits.model, reason)
        if logits.parent is not None:  # stock's arithmetic: all positions, then the slice
            parent, key = logits.parent
            out = materialize(parent, reason)[key].contiguous()
        else:
            out = logits.head(logits.hidden)
        for kind, value in logits.ops:
            out = _apply_op(out, kind, value)
        logits.real = out
    return logits.real


def _skipped(value, optional) -> bool:
    """Whether the stock code's guard around a transform skipped it for this ``value``."""
    if optional == "notnone":
        return value is None
    if optional == "truthy":  # `if E:`; a tensor of several values is left to the operand check
        if isinstance(value, torch.Tensor):
            return value.numel() == 1 and not bool(value)
        return not value
    return False


def _operand(kind: str, value):
    """``(operand, None)`` as the fused loss takes it — a float, or the 0-d tensor itself when
    it requires grad (folded into the hidden states) — or ``(None, reason)`` when the fused
    loss cannot take it (one host read of a tensor operand at most)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None, f"its logit {kind} operand has shape {tuple(value.shape)}, not a scalar"
        if value.requires_grad and torch.is_grad_enabled():
            if kind == "softcap":
                return None, "its final-logit softcap requires grad"
            return value.reshape(()), None
        if forward_ad_open() and forward_ad_dual(value):  # .item() would drop its tangent
            return None, f"forward-mode AD (a dual tensor) reaches its logit {kind} operand"
        if not torch.compiler.is_compiling() and _errors.cuda_graph_capturing(value.device):
            return None, "a CUDA graph is being captured (its logit operand is read on the host)"
        value = value.item()
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None, f"its logit {kind} operand {value!r} is not a number"
    if not math.isfinite(value) or (kind == "softcap" and value <= 0) or (
            kind == "div" and value == 0):
        return None, f"its logit {kind} operand is {value}"
    return value, None


def _transform(logits, kind: str, value, optional):
    if _skipped(value, optional):
        return logits  # e.g. `if config.final_logit_softcapping is not None:` was false
    if isinstance(logits, torch.Tensor):  # already materialised: the stock statement itself
        return _apply_op(logits, kind, value)
    logits.ops.append((kind, value))
    if logits.real is not None:
        logits.real = _apply_op(logits.real, kind, value)
        return logits
    if kind == "float":
        return logits
    if kind in ("capcall", "capfn"):
        value, odd = callable_softcap(kind, value)
        if odd is not None:
            materialize(logits, odd)
            return logits
        if value is None:  # `soft_cap(logits, None)` returns its input
            return logits
        kind = "softcap"
    if kind == "softcap" and logits.softcap is not None:
        materialize(logits, "two softcaps apply to its logits")
        return logits
    operand, odd = _operand(kind, value)
    if odd is None and logits.softcap is not None and kind != "softcap":
        odd = "a logit scale follows its softcap"
    if odd is not None:
        materialize(logits, odd)
        return logits
    if kind == "softcap":
        logits.softcap = operand
        return logits
    # a tensor operand (requires grad): (s h) W^T + s b = s (h W^T + b), autograd gives s its
    # exact gradient
    factor = operand if kind == "mul" else 1.0 / operand
    logits.scale = factor if logits.scale is None else logits.scale * factor
    return logits


def _flat_view(t: torch.Tensor) -> bool:
    """Whether ``t.view(-1)`` works (stock's loss views its ``shift_labels`` so)."""
    try:
        t.view(-1)
    except RuntimeError:
        return False
    return True


def _vocab_rows(head, hidden) -> int:
    return head.out_features if hasattr(head, "out_features") \
        else head_operands(head, hidden)[1].shape[0]


def _done(logits):
    if isinstance(logits, DeferredLogits):
        if logits.real is not None:
            return logits.real
        return NotMaterializedLogits(tuple(logits.shape))
    return logits


def _loss_refusal(logits: DeferredLogits, labels, shift_labels, vocab_size,
                  num_items_in_batch) -> str | None:
    """Why this call's loss should be the stock computation (real logits), or None.

    Everything the stock loss would treat differently from the fused one, or refuse with
    another exception: a head that cannot be read as one linear map now (a hook or a new head
    module added after the patch), labels of another dtype than int64, a ``vocab_size`` that is
    not the head's, a ``num_items_in_batch`` that is not a real number, 16-bit/32-bit operands
    mixed outside autocast, functorch transforms (``torch.func.grad``, ``vmap``), which
    the fused ``autograd.Function`` does not support, and an eager call while a CUDA graph is
    being captured (the fused loss reads its labels on the host; stock's loss does not).
    """
    try:
        check_head(logits.head)
    except UnsupportedModelError as exc:
        return f"its lm_head cannot be read as one linear map now ({str(exc).split('. ')[0]})"
    target = shift_labels if shift_labels is not None else labels
    if isinstance(target, torch.Tensor) and target.dtype != torch.int64:
        return f"its labels are {target.dtype}, not torch.int64"
    if isinstance(shift_labels, torch.Tensor) and not _flat_view(shift_labels):
        # ForCausalLMLoss takes shift_labels.view(-1): its RuntimeError, not a fused loss
        return "its shift_labels cannot be viewed as one dimension"
    if logits.softcap is not None and torch.tanh is not torch._C._VariableFunctions.tanh:
        return "torch.tanh (its final-logit softcap) was replaced process-wide"
    # A parametrized weight is evaluated once, by the loss (hf/head.py); its stored tensor may
    # have another shape or dtype, so these checks are left to the loss then (also for one
    # inside the head, a LoRA layer's base layer, whose ``weight`` property would evaluate it).
    computed = parametrized_anywhere(logits.head)
    weight = getattr(logits.head, "weight", None) if not computed else None
    if vocab_size is not None and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
            and type(weight).__name__ != "DTensor" and int(vocab_size) != weight.shape[0]:
        return f"vocab_size {vocab_size} is not its lm_head's {weight.shape[0]} rows"
    if isinstance(weight, torch.Tensor) and weight.dtype != logits.hidden.dtype \
            and not torch.is_autocast_enabled(logits.hidden.device.type) \
            and not fp32_output_head(logits.head):  # that head casts its operands itself
        return (f"its hidden states ({logits.hidden.dtype}) and lm_head weight ({weight.dtype}) "
                f"differ in dtype")
    n = num_items_in_batch
    if n is not None and (isinstance(n, bool) or (
            isinstance(n, torch.Tensor) and (n.dtype == torch.bool or n.is_complex()))
            or not isinstance(n, (numbers.Real, torch.Tensor))):
        return f"its num_items_in_batch is {type(n).__name__} {n!r:.40}"
    if isinstance(n, torch.Tensor) and n.requires_grad and torch.is_grad_enabled():
        return "its num_items_in_batch requires grad (the fused loss gives it none)"
    if isinstance(n, torch.Tensor) and n.numel() != 1:
        # stock divides by it anyway (a loss of n's shape, refused at backward)
        return f"its num_items_in_batch has shape {tuple(n.shape)}, not one number"
    if functorch_active():
        return "a functorch transform (torch.func.grad / vmap) is active"
    if not torch.compiler.is_compiling() and _errors.cuda_graph_capturing(logits.hidden.device):
        return "a CUDA graph is being captured (the fused loss reads its labels on the host)"
    if forward_ad_open() and forward_ad_dual(
            logits.hidden, n, logits.scale, weight,
            getattr(logits.head, "bias", None) if not computed else None,
            *_stored_tensors(logits.head)):
        return "forward-mode AD (a dual tensor) reaches its loss"
    return None



def _stored_tensors(head):
    """Every tensor the head module and its submodules hold (parameters, buffers, and plain
    tensor attributes: the forward-AD tutorial's ``setattr`` of a dual), read without running a
    parametrization: what a forward-mode tangent could reach the loss through."""
    for m in head.modules():
        yield from m._parameters.values()
        yield from m._buffers.values()
        yield from (v for v in vars(m).values() if isinstance(v, torch.Tensor))


def _loss(model, *args, **kwargs):
    logits = args[0] if args else kwargs.get("logits")
    if not isinstance(logits, DeferredLogits):
        return model.loss_function(*args, **kwargs)  # materialised: the stock call itself
    if logits.real is None:
        names = ("logits", "labels", "vocab_size", "num_items_in_batch")
        bound = dict(zip(names, args), **kwargs)
        reason = _loss_refusal(logits, bound.get("labels"), bound.get("shift_labels"),
                               bound.get("vocab_size"), bound.get("num_items_in_batch"))
        if reason is None:
            return fused_head_loss(*args, **kwargs)
        materialize(logits, reason)
    if args:
        args = (logits.real, *args[1:])
    else:
        kwargs = {**kwargs, "logits": logits.real}
    return model.loss_function(*args, **kwargs)



# -- the CrossEntropyLoss form and extra loss terms (architectures._rewrite_ce_block) ----------

_CE_CLASS = torch.nn.CrossEntropyLoss
_CE_FORWARD = torch.nn.CrossEntropyLoss.forward
_F_CROSS_ENTROPY = torch.nn.functional.cross_entropy


def _ce(model, loss_fct, logits, vocab_size, target):
    """Stands in for ``loss_fct(logits.view(-1, vocab_size), target)`` in the loss block
    ``loss_fct = CrossEntropyLoss(); loss = loss_fct(logits.view(-1, V), labels.view(-1))``
    (``vocab_size`` None: ``logits.size(-1)``): the fused loss where it computes stock's
    number (:func:`fused_module_ce_loss`), else that very call on real logits."""
    if isinstance(logits, DeferredLogits):
        if logits.real is None:
            reason = _ce_refusal(loss_fct, logits, vocab_size, target)
            if reason is None:
                return fused_module_ce_loss(logits, target, loss_fct.ignore_index, vocab_size)
            materialize(logits, reason)
        logits = logits.real
    return loss_fct(logits.view(-1, logits.size(-1) if vocab_size is None else vocab_size),
                    target)


def _ce_refusal(loss_fct, logits: DeferredLogits, vocab_size, target) -> str | None:
    """Why ``loss_fct(logits.view(-1, V), target)`` should run on real logits, or None.

    The fused loss is that call only for a plain ``torch.nn.CrossEntropyLoss`` with torch's
    own ``forward`` and ``F.cross_entropy``, no class weights, ``reduction="mean"``, no label
    smoothing and no hooks (a modeling module's ``CrossEntropyLoss`` global replaced, e.g. by
    Liger-Kernel, fails this); for 1-D int64 labels on the logits' device, one per kept row;
    for ``V`` the head's row count; and for whatever :func:`_loss_refusal` accepts. Everything
    else is stock's business, errors included (``.view`` of a wrong ``V`` raises there).
    """
    kind = type(loss_fct)
    if kind is not _CE_CLASS or _CE_CLASS is not torch.nn.CrossEntropyLoss:
        return (f"its loss module is {kind.__module__}.{kind.__qualname__}, not "
                f"torch.nn.CrossEntropyLoss")
    if kind.forward is not _CE_FORWARD or kind.__call__ is not torch.nn.Module.__call__ \
            or torch.nn.functional.cross_entropy is not _F_CROSS_ENTROPY \
            or _F_CROSS_ENTROPY.__module__ != "torch.nn.functional":
        return "torch's CrossEntropyLoss or cross_entropy was replaced"
    if loss_fct._forward_hooks or loss_fct._forward_pre_hooks:
        return "its CrossEntropyLoss module has hooks"
    if loss_fct.weight is not None or loss_fct.reduction != "mean" \
            or loss_fct.label_smoothing != 0.0 or isinstance(loss_fct.ignore_index, bool) \
            or not isinstance(loss_fct.ignore_index, int):
        return (f"its CrossEntropyLoss has weight={'set' if loss_fct.weight is not None else None}"
                f", reduction={loss_fct.reduction!r}, label_smoothing="
                f"{loss_fct.label_smoothing}, ignore_index={loss_fct.ignore_index!r}")
    if vocab_size is not None and (isinstance(vocab_size, bool)
                                   or not isinstance(vocab_size, numbers.Integral)):
        return f"its vocab_size is {type(vocab_size).__name__} {vocab_size!r:.40}"
    if vocab_size is not None and parametrized(logits.head):
        return "its lm_head weight is parametrized (its rows are known only when read)"
    if not isinstance(target, torch.Tensor) or target.dim() != 1 \
            or target.numel() != logits.hidden.shape[:-1].numel():
        shape = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        return f"its labels ({shape}) are not one per kept position"
    if target.device != logits.device:
        return f"its labels are on {target.device}, its logits on {logits.device}"
    return _loss_refusal(logits, target, None, vocab_size, None)


def _stock_logits_dtype(logits: DeferredLogits) -> torch.dtype:
    """The dtype of stock's ``head(hidden)``: the hidden states' (equal to the weight's, or
    :func:`_loss_refusal` refused), or under autocast what autocast's ``linear`` gives."""
    h = logits.hidden
    if not torch.is_autocast_enabled(h.device.type):
        return h.dtype
    weight = getattr(logits.head, "weight", None)
    w_dtype = weight.dtype if isinstance(weight, torch.Tensor) else h.dtype
    with torch.no_grad():  # a 1x1 probe of what autocast does with these dtypes
        return torch.nn.functional.linear(torch.zeros(1, 1, dtype=h.dtype, device=h.device),
                                          torch.zeros(1, 1, dtype=w_dtype,
                                                      device=h.device)).dtype


def fused_module_ce_loss(logits: DeferredLogits, target: torch.Tensor,
                         ignore_index: int, vocab_size=None) -> torch.Tensor:
    """``CrossEntropyLoss(ignore_index=ignore_index)(logits.view(-1, V), target)`` from the
    deferred head operands: no shift, the mean over counted rows, NaN when none counts (stock's
    0/0; gradients 0 as stock's), in the dtype stock's call returns (the logits dtype; under
    autocast what autocast's ``cross_entropy`` returns).

    Args:
        logits: the deferred logits (``[..., H]`` kept hidden states, head, transforms).
        target: ``[N]`` int64 labels, ``N`` the number of kept positions, on their device.
        ignore_index: the module's ``ignore_index``.
        vocab_size: ``V`` of the stock call's ``logits.view(-1, V)`` (None: the head's rows).
            Checked against the rows the loss read when :func:`_ce_refusal` could not (a
            tensor-parallel head's ``DTensor`` weight): stock's errors.

    Returns:
        0-d loss.

    Raises:
        RuntimeError: ``vocab_size`` does not divide ``N * rows`` (stock's ``.view``).
        ValueError: ``vocab_size`` divides it but is not the head's rows (stock's batch-size
            mismatch); a label outside ``[0, V)`` that is not ``ignore_index``
            (:class:`~fused_ce_patch.errors.LabelOutOfRangeError`, also an ``IndexError`` as
            torch's).
    """
    h = logits.hidden
    h = h.reshape(-1, h.shape[-1])
    scale = logits.scale
    if isinstance(scale, torch.Tensor):
        scale = scale.to(h.dtype)
    options = logits.options
    loss, vocab = _head_loss(logits.head, h, target, logit_scale=scale,
                             ignore_index=ignore_index, shift=False, softcap=logits.softcap,
                             logits_budget=options.logits_budget, backend=options.backend)
    if vocab_size is not None and int(vocab_size) != vocab:
        numel = h.shape[0] * vocab
        if numel % int(vocab_size):
            raise RuntimeError(f"shape '[-1, {int(vocab_size)}]' is invalid for input of size "
                               f"{numel}")
        raise ValueError(f"Expected input batch_size ({numel // int(vocab_size)}) to match "
                         f"target batch_size ({target.shape[0]}).")
    nan = torch.where((target != ignore_index).any(), 0.0, float("nan"))
    loss = loss + nan.to(device=loss.device, dtype=loss.dtype)
    dtype = _stock_logits_dtype(logits)
    if torch.is_autocast_enabled(h.device.type):
        with torch.no_grad():  # autocast may compute cross_entropy in float32
            dtype = _F_CROSS_ENTROPY(torch.zeros(1, 1, dtype=dtype, device=h.device),
                                     torch.zeros(1, dtype=torch.long, device=h.device)).dtype
    return loss.to(dtype)


def _lse_refusal(logits: DeferredLogits, dim) -> str | None:
    """Why ``logits.logsumexp(dim=dim)`` should be computed from real logits, or None."""
    if isinstance(dim, bool) or dim not in (-1, logits.hidden.dim() - 1):
        return f"an extra loss term takes logsumexp over dim {dim!r}"
    if logits.scale is not None or logits.softcap is not None:
        return "an extra loss term takes the logsumexp of transformed logits"
    if torch.is_autocast_enabled(logits.hidden.device.type):
        return "an extra loss term takes logsumexp under autocast"
    return _loss_refusal(logits, None, None, None, None)


def _fused_lse(logits: DeferredLogits) -> torch.Tensor:
    """Stock's ``logits.logsumexp(dim=-1)`` without the logits, or from real ones when the head
    cannot be read that way (:func:`~.head.fused_head_lse`)."""
    options = logits.options
    try:
        lse = fused_head_lse(logits.head, logits.hidden, logits_budget=options.logits_budget,
                             backend=options.backend)
    except UnsupportedModelError as exc:
        return materialize(logits, str(exc)).logsumexp(dim=-1)
    return lse.to(logits.hidden.dtype)


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

    Same arguments and result as transformers' ``ForCausalLMLoss``, computed with
    :func:`~fused_ce_patch.fused_linear_cross_entropy` from the deferred head operands: the
    mean over counted positions (NaN when none counts, as stock), or ``sum /
    num_items_in_batch`` when that is given.

    Raises:
        ValueError: neither labels nor shift_labels; labels that do not match the kept hidden
            states; ``vocab_size`` other than the head's rows that divides ``N * rows``
            (stock's batch-size mismatch); a label outside ``[0, V)``.
        RuntimeError: ``vocab_size`` that does not divide ``N * rows`` (stock's ``.view``).
        TypeError: labels or shift_labels not a tensor (a list, a numpy array), as stock.
    """
    hidden = logits.hidden
    if labels is None and shift_labels is None:
        raise ValueError("fused_ce_patch: the loss needs labels or shift_labels")
    for name, value in (("labels", labels), ("shift_labels", shift_labels)):
        if value is not None and not isinstance(value, torch.Tensor):
            # stock's loss raises TypeError too (F.pad / F.cross_entropy on a non-tensor)
            raise TypeError(f"fused_ce_patch: {name} must be a torch.Tensor, got "
                            f"{type(value).__module__}.{type(value).__qualname__}")
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
    scale = logits.scale
    if isinstance(scale, torch.Tensor):  # an operand that requires grad: stays in the graph
        scale = scale.to(h.dtype)
    # The one place the head is computed: inside its owning module's call where a wrapper
    # (FSDP, ZeRO-3) gathers the weight there, else from the weight directly (hf/head.py).
    loss, vocab = _head_loss(
        logits.head,
        h,
        target,
        logit_scale=scale,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
        shift=shift,
        softcap=logits.softcap,
        logits_budget=options.logits_budget,
        backend=options.backend,
    )
    if vocab_size is not None and int(vocab_size) != vocab:
        # (reached where _loss_refusal could not read the rows: a parametrized or sharded
        # head) stock's errors: ForCausalLMLoss's logits.view(-1, V), then cross_entropy
        numel = h.shape[:-1].numel() * vocab
        if numel % int(vocab_size):
            raise RuntimeError(f"shape '[-1, {int(vocab_size)}]' is invalid for input of size "
                               f"{numel}")
        raise ValueError(f"Expected input batch_size ({numel // int(vocab_size)}) to match "
                         f"target batch_size ({target.numel()}).")
    if loss.dtype != torch.float32:
        # ForCausalLMLoss computes from logits.float(): a float32 loss for every model dtype
        # (float64 included; the fused loss kept float64 arithmetic, rounded here)
        loss = loss.float()
    n = num_items_in_batch
    if isinstance(n, torch.Tensor):
        if n.dim() and n.numel() == 1:
            loss = loss.reshape(n.shape)  # stock's sum / n broadcasts to n's shape, e.g. [1]
        loss = loss.to(_quotient_dtype(loss.dtype, n))
    if num_items_in_batch is None:
        # ForCausalLMLoss takes a mean: NaN when no position counts (Trainer.evaluate drops
        # such a batch; a 0.0 would be averaged in). Gradients stay 0, as stock's do.
        counted = (target[..., 1:] if shift else target) != ignore_index
        loss = loss + torch.where(counted.any(), 0.0, float("nan")).to(loss.device)
    return loss


def _quotient_dtype(loss_dtype: torch.dtype, n: torch.Tensor) -> torch.dtype:
    """The dtype of stock's ``sum / n`` for the 0-d floating sum and a tensor ``n`` (torch's
    promotion: a floating ``n`` with dimensions gives its own dtype, a 0-d one the wider of
    the two, an integer one the sum's). Spelled out from ``n.dtype`` and ``n.dim()``, which
    torch.compile reads as constants (``torch.result_type`` breaks the graph)."""
    if not n.is_floating_point():
        return loss_dtype
    if n.dim():
        return n.dtype
    return torch.float64 if torch.float64 in (loss_dtype, n.dtype) else loss_dtype


def _shift_left(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)

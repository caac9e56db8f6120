"""The public loss: :func:`fused_linear_cross_entropy` and :class:`FusedLinearCrossEntropyLoss`.

This module validates and normalises a call once (options, shapes, dtypes, autocast, shift,
labels, reduction) and hands a flat :class:`~fused_ce_patch.backends.Problem` to one backend.
"""

from __future__ import annotations

import math
import numbers
import struct

import torch
from torch import nn
from torch.autograd import forward_ad as _forward_ad

from . import backends, errors
from .backends.base import LossSpec, Problem
from .errors import LabelOutOfRangeError
from .backends.nonfinite_scale import run_nonfinite_scale
from .types import BackendName, Reduction

REDUCTIONS = ("mean", "sum", "none")


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    shift: bool = False,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logits_budget: int | None = None,
    backend: BackendName = "auto",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` without storing the
    ``[N, V]`` logits.

    Per counted position (label != ``ignore_index``), with logits ``z`` (softcapped to
    ``c * tanh(z / c)`` when ``softcap=c``)::

        loss = LSE(z) - z_y
             + label_smoothing * (mean_v(LSE - z_v) - (LSE - z_y))
             + z_loss * LSE**2

    Args:
        hidden: ``[..., H]`` float16, bfloat16, float32 or float64 last hidden states.
        weight: ``[V, H]`` lm_head weight, same dtype and device as ``hidden`` (outside
            autocast; under ``torch.autocast`` both are cast as ``lm_head(hidden)`` would be,
            and gradients flow back to the original parameters).
        labels: ``[...]`` (``hidden.shape[:-1]``) int64 or int32 class indices in
            ``[0, V)`` or ``ignore_index`` (other integer dtypes are refused: a uint8 or int8
            tensor cannot hold ``-100`` and is most likely a mask passed by mistake).
        bias: ``[V]`` lm_head bias, or None.
        ignore_index: int label value of positions that add nothing to the loss, the counts
            or any gradient.
        reduction: ``"mean"`` (over counted positions; 0.0 with zero gradients when none is
            counted, unlike torch's NaN), ``"sum"``, or ``"none"`` (``labels``-shaped losses,
            0 at ignored positions, float32).
        num_items_in_batch: if given (a Python/NumPy int or float, or a tensor with one
            element, of an integer or floating dtype, on any device), the result is
            ``sum / num_items_in_batch`` — transformers' convention for exact gradient
            accumulation — for every value, as stock computes it: 0 gives inf (NaN when the
            sum is 0), a negative value a negative loss, NaN gives NaN, inf gives 0; the
            gradient is autograd's of that division (see
            :mod:`fused_ce_patch.backends.nonfinite_scale` for 0 and NaN). A tensor's value
            is read in float32 (the dtype of the sum); the result stays 0-d float32 (float64
            for float64 inputs) whatever the divisor's shape or dtype. Not allowed with
            ``reduction="none"``.
        shift: causal shift: position ``t`` predicts ``labels[..., t + 1]``; the last position
            of each sequence predicts nothing. **Pass True when ``labels`` are the input ids**
            (the usual causal-LM call): without it the result is a different loss, and no
            check can tell (pre-shifted labels look the same). Leave False for labels that are
            already shifted (transformers' ``shift_labels``).
        softcap: final-logit softcapping ``c > 0`` (Gemma-2 uses 30), or None.
        label_smoothing: ``eps`` in ``[0, 1]``, torch's definition.
        z_loss: ``lambda >= 0`` of the PaLM z-loss ``lambda * LSE**2`` (Chowdhery et al.,
            "PaLM", 2022).
        logits_budget: bytes of transient logits one chunk may hold; 0 keeps none (tiles live
            on chip only where the backend can do that); None takes the backend's default.
        backend: ``"auto"``, ``"triton"``, ``"ascend"``, ``"torch"`` or ``"reference"``
            (``$FUSED_CE_BACKEND`` overrides ``"auto"``). ``"auto"`` picks the backend of the
            tensors' real device type (``triton`` for CUDA, ``ascend`` for NPU, ``torch``
            otherwise); ``TRITON_INTERPRET=1`` never makes it pick a Triton backend for CPU
            tensors (ask for ``backend="triton"`` explicitly to use the interpreter).

    Numeric options never accept a bool (``softcap=True`` is a ``TypeError``, not 1.0):
    ``ignore_index`` and ``logits_budget`` must be ints; ``softcap``, ``label_smoothing``
    and ``z_loss`` Python/NumPy numbers.

    Returns:
        A 0-d float32 loss (float64 for float64 inputs), or ``labels``-shaped per-position
        losses with ``reduction="none"``.

    Raises:
        ValueError: a label outside ``[0, V)`` that is not ``ignore_index`` (names the value
            and V); mismatched shapes (names both); unknown reduction or backend (lists the
            valid ones); an option out of range; meta-device (data-less) tensors; a
            ``num_items_in_batch`` tensor that requires grad or carries a forward-mode AD
            tangent (it would get no gradient).
        TypeError: ``hidden``, ``weight`` and ``bias`` dtypes differ outside autocast; labels
            not int64/int32; inputs not floating point; an option of the wrong type (a bool
            for any numeric option, a float ``ignore_index`` or ``logits_budget``; a
            ``num_items_in_batch`` that is not a real number or a one-element tensor of an
            integer or floating dtype: bool, complex, str).
        BackendUnavailableError: the requested backend cannot run on this device.
        RuntimeError: called while a CUDA graph is being captured (the label check reads the
            host; ``torch.compile(mode="reduce-overhead")`` captures around the loss).

    Source: Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (2024) for
    the blockwise log-sum-exp; PyTorch ``F.cross_entropy`` and transformers' ``ForCausalLMLoss``
    for the reduction, label smoothing and ``num_items_in_batch`` semantics.
    """
    _check_options(
        reduction, backend, num_items_in_batch, softcap, label_smoothing, z_loss, logits_budget
    )
    ignore_index = _check_ignore_index(ignore_index)
    _check_shift(shift)
    _check_real_tensors(hidden, weight, labels, bias)  # before autocast, which rejects meta
    hidden, weight, bias = _autocast(hidden, weight, bias)
    if torch.compiler.is_compiling():  # Dynamo: one opaque custom op, no graph break (ops.py)
        return _TRACED_CALL[0](
            hidden, weight, labels, bias=bias, ignore_index=ignore_index, reduction=reduction,
            num_items_in_batch=num_items_in_batch, shift=shift, softcap=softcap,
            label_smoothing=label_smoothing, z_loss=z_loss, logits_budget=logits_budget,
            backend=backend,
        )
    _check_tensors(hidden, weight, labels, bias)
    if labels.dtype != torch.int64:
        labels = labels.long()
    if shift:
        labels = _shift(labels, ignore_index)
    flat_labels = labels.reshape(-1)
    valid_rows, n_valid, num_items = _check_labels_and_num_items(
        flat_labels, weight.shape[0], ignore_index, num_items_in_batch
    )

    impl = backends.resolve(backend, hidden.device, hidden.dtype)
    problem = Problem(
        hidden=hidden,
        weight=weight,
        bias=bias,
        labels=flat_labels,
        valid_rows=valid_rows,
        n_valid=n_valid,
        spec=LossSpec(
            ignore_index=ignore_index,
            softcap=None if softcap is None else float(softcap),
            label_smoothing=float(label_smoothing),
            z_loss=float(z_loss),
        ),
        reduction="none" if reduction == "none" else "sum",
        scale=_scale(reduction, num_items, n_valid),
        logits_budget=logits_budget,
    )
    with torch.autocast(hidden.device.type, enabled=False):
        if math.isfinite(problem.scale):
            out = impl.run(problem)
        else:  # num_items_in_batch is 0 or NaN: inf/NaN as stock, and stock's gradient
            out = run_nonfinite_scale(problem, impl)
    if reduction == "none":
        return out.view(labels.shape)
    return out


class FusedLinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`; options are fixed at construction.

    ``forward(hidden, weight, labels, bias=None, num_items_in_batch=None)`` takes the same
    tensors as the function (argument order of ``torch.nn.functional.linear``).
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: Reduction = "mean",
        shift: bool = False,
        softcap: float | None = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        logits_budget: int | None = None,
        backend: BackendName = "auto",
    ):
        super().__init__()
        _check_options(reduction, backend, None, softcap, label_smoothing, z_loss, logits_budget)
        _check_shift(shift)
        self.ignore_index = _check_ignore_index(ignore_index)
        self.reduction = reduction
        self.shift = shift
        self.softcap = softcap
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.logits_budget = logits_budget
        self.backend = backend

    def forward(self, hidden, weight, labels, bias=None, num_items_in_batch=None):
        return fused_linear_cross_entropy(
            hidden,
            weight,
            labels,
            bias=bias,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            num_items_in_batch=num_items_in_batch,
            shift=self.shift,
            softcap=self.softcap,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            logits_budget=self.logits_budget,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        opts = []
        for name in ("reduction", "ignore_index", "shift", "softcap", "label_smoothing",
                     "z_loss", "logits_budget", "backend"):
            opts.append(f"{name}={getattr(self, name)!r}")
        return ", ".join(opts)


# -- validation and normalisation ------------------------------------------------------------


def _is_number(value, kind) -> bool:
    # bool is an int to Python, but True as a softcap or an ignore_index is a mistake.
    return isinstance(value, kind) and not isinstance(value, (bool, torch.Tensor))


def _number_error(name, value, what):
    return TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


def _check_ignore_index(ignore_index) -> int:
    """``ignore_index`` as a Python int; a bool, float or tensor raises ``TypeError``."""
    if not _is_number(ignore_index, numbers.Integral):
        raise _number_error("ignore_index", ignore_index, "an int (e.g. -100)")
    return int(ignore_index)


def _check_shift(shift) -> None:
    """``shift`` must be a bool: a string such as ``"no"`` is truthy and would shift."""
    if not isinstance(shift, bool):
        raise TypeError(f"shift must be True or False, got {type(shift).__name__} {shift!r}")


#: What a call under Dynamo runs instead of the backend: ``ops.traced_call``, registered by
#: :mod:`fused_ce_patch.ops` when the package is imported (ops depends on this module, not
#: the other way round).
_TRACED_CALL: list = []


def register_traced_call(fn) -> None:
    """Set the function :func:`fused_linear_cross_entropy` hands its call to under Dynamo."""
    _TRACED_CALL[:] = [fn]


_ALWAYS_VALID = ("auto", *backends.registry.KNOWN_NAMES)


def check_backend_name(backend) -> None:
    """Raise ``ValueError`` (listing the valid names) unless ``backend`` names a backend."""
    # backend_names() starts with these (always valid): the same ``in`` test, without
    # building the tuple of registered names on every call
    if backend in _ALWAYS_VALID:
        return
    if backend not in backends.backend_names():
        raise ValueError(
            f"unknown backend {backend!r}; valid: {', '.join(backends.backend_names())}"
        )


def _check_options(reduction, backend, num_items, softcap, label_smoothing, z_loss, budget):
    """Options of one call. Type first (``TypeError``: bools are refused for every numeric
    option, so ``softcap=True`` cannot mean 1.0), then range (``ValueError``)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; valid: {', '.join(REDUCTIONS)}")
    check_backend_name(backend)
    if num_items is not None:
        if reduction == "none":
            raise ValueError("num_items_in_batch cannot be combined with reduction='none'")
        _check_num_items(num_items)
    if softcap is not None:
        if not _is_number(softcap, numbers.Real):
            raise _number_error("softcap", softcap, "None or a number")
        if not 0 < softcap < math.inf:
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap}")
    if not _is_number(label_smoothing, numbers.Real):
        raise _number_error("label_smoothing", label_smoothing, "a number")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not _is_number(z_loss, numbers.Real):
        raise _number_error("z_loss", z_loss, "a number")
    if not 0.0 <= z_loss < math.inf:
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    check_logits_budget(budget)



#: The fused Functions take ``num_items_in_batch`` as a constant: a count that requires grad
#: (stock's ``sum / n`` would give it a gradient) is refused rather than left without one.
NUM_ITEMS_GRAD_MESSAGE = (
    "num_items_in_batch requires grad, and the fused loss gives it no gradient; pass "
    "num_items_in_batch.detach(), or divide the reduction='sum' loss by it yourself")

#: The same for a forward-mode AD tangent (``torch.autograd.forward_ad``) on it.
NUM_ITEMS_TANGENT_MESSAGE = (
    "num_items_in_batch carries a forward-mode AD tangent, and the fused loss gives it none; "
    "pass its primal (forward_ad.unpack_dual(n).primal), or divide the reduction='sum' loss by "
    "it yourself")


def _check_num_items(num_items) -> None:
    """Type and size of ``num_items_in_batch`` (any value of a real number is valid).

    Raises:
        TypeError: a bool, complex, str or other non-real value, or a bool/complex tensor.
        ValueError: a tensor with more or fewer than one element; a tensor that requires grad
            (with grad mode on).
    """
    if isinstance(num_items, torch.Tensor):
        if num_items.requires_grad and torch.is_grad_enabled():
            raise ValueError(NUM_ITEMS_GRAD_MESSAGE)
        if getattr(_forward_ad, "_current_level", -1) >= 0 and \
                _forward_ad.unpack_dual(num_items).tangent is not None:
            raise ValueError(NUM_ITEMS_TANGENT_MESSAGE)
        if num_items.dtype == torch.bool or num_items.is_complex():
            raise TypeError(
                f"num_items_in_batch must be a real number (an integer or floating tensor), "
                f"got a {num_items.dtype} tensor"
            )
        if num_items.numel() != 1:
            raise ValueError(
                f"num_items_in_batch must hold one number, got shape {tuple(num_items.shape)}"
            )
    # SymInt / SymFloat: a Python number that torch.compile traces symbolically
    elif not (_is_number(num_items, numbers.Real)
              or isinstance(num_items, (torch.SymInt, torch.SymFloat))):
        raise _number_error("num_items_in_batch", num_items,
                            "a real number (int or float) or a one-element tensor")


def check_logits_budget(budget) -> None:
    """``logits_budget``: None or an int >= 0 (bytes).

    Raises:
        TypeError: a bool, float or anything else that is not an int.
        ValueError: a negative int.
    """
    if budget is None:
        return
    if not _is_number(budget, numbers.Integral):
        raise _number_error("logits_budget", budget, "None or an int >= 0 (bytes)")
    if budget < 0:
        raise ValueError(f"logits_budget must be None or an int >= 0 (bytes), got {budget!r}")


def _check_real_tensors(hidden, weight, labels, bias):
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("hidden and weight must be tensors")
    if not (hidden.is_meta or weight.is_meta or isinstance(labels, torch.Tensor) and labels.is_meta
            or isinstance(bias, torch.Tensor) and bias.is_meta):
        return  # the usual case: the loop below only names the meta one
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels), ("bias", bias)):
        if isinstance(t, torch.Tensor) and t.is_meta:
            raise ValueError(
                f"{name} is a meta tensor (shape only, no data): the loss needs real values. "
                f"Load or initialise the model's weights (e.g. from_pretrained, or "
                f"model.to_empty(device=...) and then init) before training"
            )


def _autocast(hidden, weight, bias):
    """Cast as ``lm_head(hidden)`` would be under autocast; autograd flows through the cast."""
    device_type = hidden.device.type
    if not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        if t is None or not t.is_floating_point() or t.dtype == torch.float64:
            return t
        return t.to(dtype)

    return cast(hidden), cast(weight), cast(bias)


def _check_tensors(hidden, weight, labels, bias):
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be an integer tensor, got {type(labels).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(
            f"weight [V, H] must have V >= 1 and H >= 1, got shape {tuple(weight.shape)}"
        )
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden [..., H] and weight [V, H] disagree on H: hidden {tuple(hidden.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have hidden's leading shape: labels {tuple(labels.shape)}, "
            f"hidden {tuple(hidden.shape)} (expected {tuple(hidden.shape[:-1])})"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(
            f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)} "
            f"(weight {tuple(weight.shape)})"
        )
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(
            f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            hint = (
                "autocast leaves float64 tensors alone, so cast one of them"
                if torch.is_autocast_enabled(hidden.device.type)
                else "cast one of them, or run under torch.autocast to cast both as lm_head "
                "would"
            )
            raise TypeError(f"hidden is {hidden.dtype} but {name} is {t.dtype}; {hint}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"labels must be an integer tensor of dtype int64 or int32, got {labels.dtype}"
        )
    for name, t in (("weight", weight), ("labels", labels), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"hidden is on {hidden.device} but {name} is on {t.device}")


def _shift(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    if labels.dim() < 1:
        raise ValueError("shift=True needs labels with a sequence dimension")
    if labels.shape[-1] == 0:
        return labels
    pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def _check_labels(labels: torch.Tensor, vocab: int, ignore_index: int):
    """Indices of counted rows and their number; raises on an out-of-range label.

    Costs one fused min/max reduction (plus a count) over the ``[N]`` labels and one host
    synchronisation. The counted rows' indices then come from ``nonzero_static`` with the
    count already on the host, so no second sync follows (``nonzero`` would sync again while
    the device sits idle before the loss's first matmul); only when some rows are ignored.
    """
    valid_rows, n_valid, _ = _check_labels_and_num_items(labels, vocab, ignore_index, None)
    return valid_rows, n_valid


def _check_labels_and_num_items(labels, vocab: int, ignore_index: int, num_items):
    """:func:`_check_labels`, and ``num_items_in_batch`` as a Python float (a tensor's value
    taken in float32, the dtype of the sum it divides).

    A ``num_items_in_batch`` tensor on the labels' device joins the labels' one host
    synchronisation: its float32 bits ride along with the int64 label statistics (float64
    is not available on every device type), so knowing it on the host costs no extra sync.
    """
    errors.raise_if_capturing(labels.device, "the fused loss")  # the host read below
    n = labels.shape[0]
    items_t = None
    if isinstance(num_items, torch.Tensor):
        items_t = num_items.detach().reshape(()).to(torch.float32)
        if items_t.device.type == "cpu" and labels.device.type != "cpu":
            num_items, items_t = items_t.item(), None  # on the host already: no sync
    if n == 0:
        if items_t is not None:
            num_items = items_t.item()
        return labels.new_empty(0), 0, _as_float(num_items)
    counted = labels != ignore_index
    lo, hi = torch.aminmax(torch.where(counted, labels, 0))
    stats = [lo, hi, counted.sum()]
    if items_t is not None:
        stats.append(items_t.to(labels.device).view(torch.int32).to(torch.int64))
    values = torch.stack(stats).tolist()
    lo, hi, n_valid = values[:3]
    if items_t is not None:
        num_items = struct.unpack("<f", struct.pack("<I", values[3] & 0xFFFFFFFF))[0]
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise LabelOutOfRangeError(
            f"label {bad} is outside [0, V) with V = {vocab} and is not "
            f"ignore_index = {ignore_index}"
        )
    if n_valid == n:
        valid_rows = torch.arange(n, device=labels.device)
    else:
        valid_rows = _counted_rows(counted, n_valid)
    return valid_rows, n_valid, _as_float(num_items)


def _as_float(value):
    return None if value is None else float(value)


def _counted_rows(counted: torch.Tensor, n_valid: int) -> torch.Tensor:
    """Indices of the ``True`` entries of ``counted`` (``n_valid`` of them, known)."""
    try:
        return torch.nonzero_static(counted, size=n_valid).squeeze(1)
    except NotImplementedError:  # a device type without it (torch_npu builds may lack it)
        return counted.nonzero().squeeze(1)


def _scale(reduction, num_items, n_valid) -> float:
    """Multiplier of the loss sum: ``1 / num_items_in_batch`` for every value (inf for 0,
    NaN for NaN, 0 for inf, keeping the sign of a signed zero), else ``1 / counted`` for a
    mean (1 with no counted position: the documented 0.0), else 1."""
    if num_items is not None:
        if num_items == 0:
            return math.copysign(math.inf, num_items)
        return 1.0 / num_items  # NaN stays NaN, inf gives 0.0
    if reduction == "mean":
        return 1.0 / max(n_valid, 1)
    return 1.0

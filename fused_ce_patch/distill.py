"""Knowledge distillation from hidden states: :func:`fused_linear_jsd`, the generalized
Jensen-Shannon divergence between a student's and a teacher's next-token distributions,
without materialising either model's ``[tokens, vocab]`` logits.

This module validates and normalises a call once, then hands it to the chunked computation
of :mod:`fused_ce_patch.backends.distill_chunked`.
"""

from __future__ import annotations

import math
import numbers

import torch

from .backends.distill_chunked import BACKENDS, DivergenceSpec, run_divergence
from .errors import raise_if_capturing
from .loss import NUM_ITEMS_GRAD_MESSAGE, _autocast

REDUCTIONS = ("batchmean", "sum", "mean", "none")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fused_linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch: int | float | torch.Tensor | None = None,
    ignore_index: int = -100,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    logits_budget: int | None = None,
    return_student_entropy: bool = False,
    backend: str = "auto",
):
    """Generalized JSD of GKD between ``softmax(zs / T)`` and ``softmax(zt / T)``, with
    ``zs = student_hidden @ student_weight.T (+ student_bias)`` and ``zt`` the teacher's
    alike, computed in row chunks so that no ``[N, V]`` tensor of either model exists.

    Equal to TRL 1.16's ``GKDTrainer.generalized_jsd_loss(zs, zt, labels, beta, temperature,
    reduction, num_items_in_batch)`` on the materialised logits. Per counted position, with
    ``ps``, ``pt`` the two distributions::

        beta == 0:  KL(pt || ps)        (F.kl_div(log ps, log pt, log_target=True), "forward")
        beta == 1:  KL(ps || pt)        ("reverse")
        otherwise:  beta KL(pt || m) + (1 - beta) KL(ps || m),  m = (1 - beta) ps + beta pt

    (TRL special-cases 0 and 1; the mixture formula tends to 0, not to the KLs, at the ends.)
    The logits are first scaled and softcapped when a model has them: ``z = c * tanh(s x / c)``
    (Gemma-2's ``final_logit_softcapping``, Cohere's ``logit_scale``), then divided by ``T``.
    The gradient formulas are in :mod:`fused_ce_patch.backends.distill_chunked`.

    Args:
        student_hidden: ``[N, Hs]`` or ``[B, T, Hs]`` float16/bfloat16/float32/float64.
        student_weight: ``[V, Hs]`` student lm_head weight, dtype and device of
            ``student_hidden``.
        teacher_hidden: ``[N, Ht]`` / ``[B, T, Ht]`` (same leading shape as the student's;
            ``Ht`` may differ from ``Hs``), same device.
        teacher_weight: ``[V, Ht]``, same ``V`` as the student's, dtype of ``teacher_hidden``.
        labels: ``[N]`` / ``[B, T]`` integer tensor or None; positions equal to
            ``ignore_index`` add nothing (to the loss, the counts or any gradient). Only the
            mask is read (the values are not used as classes).
        beta: in ``[0, 1]``.
        temperature: > 0; divides both models' logits.
        reduction: ``"batchmean"`` (sum over counted positions / their number, at least 1;
            without labels, / ``student_hidden.shape[0]`` — the batch size for 3-D input, as
            TRL), ``"sum"``, ``"mean"`` (sum / (counted positions * V), TRL's elementwise
            mean; NaN when nothing is counted) or ``"none"`` (per-position divergence
            ``[N]`` / ``[B, T]``, 0 at ignored positions: TRL's elementwise ``"none"`` summed
            over the vocabulary).
        num_items_in_batch: if given, the result is ``sum / num_items_in_batch`` whatever
            ``reduction`` is (as TRL), a 0-d tensor.
        ignore_index: label value of ignored positions.
        student_bias, teacher_bias: ``[V]`` lm_head biases, or None.
        student_logit_scale, teacher_logit_scale: multipliers of the raw logits (finite).
        student_softcap, teacher_softcap: final-logit softcaps ``c > 0``, or None.
        logits_budget: bytes the transient logits work of one chunk (both models, float32)
            may hold; None: the device's default (192 MiB on the CPU, 384 MiB on CUDA). At
            least one row is held whatever the budget.
        return_student_entropy: also return the student's per-position entropy (of
            ``softmax(zs / T)``), ``[N]`` / ``[B, T]`` float32, 0 at ignored positions, no
            gradient.
        backend: ``"auto"`` (a Triton row kernel on CUDA, torch ops elsewhere: CPU, Ascend
            NPUs, MPS), ``"torch"`` or ``"triton"``.

    Returns:
        The loss (0-d float32, or per-position float32 for ``"none"``; float64 when a
        weight is float64), or ``(loss, student_entropy)`` with ``return_student_entropy``.
        Gradients flow to the student's hidden states, weight and bias, and to the
        teacher's wherever they require grad. Arithmetic after the matmuls is float32; the
        matmuls take the inputs' dtype with float32 results.

    Raises:
        ValueError: vocabulary sizes differ or are 0; hidden size and weight columns differ; leading
            shapes differ; labels shape mismatch; beta outside [0, 1]; temperature <= 0;
            unknown reduction; a bad budget or softcap; a ``num_items_in_batch`` tensor
            that requires grad (it would get no gradient).
        BackendUnavailableError: ``backend="triton"`` where Triton cannot run.
        TypeError: non-tensor inputs, non-float dtypes, hidden/weight dtypes differ,
            non-integer labels.
        RuntimeError: called while a CUDA graph is being captured (it reads counts on the
            host).

    Under autocast, each model's hidden states, weight and bias are cast to the autocast
    dtype as its ``lm_head`` call would be (float64 stays), and the loss is then computed with
    autocast off: float32 accumulation, as without it.

    Source: Agarwal et al., "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes" (ICLR 2024), Eq. 1; TRL 1.16 ``generalized_jsd_loss`` for the
    conventions and reductions.
    """
    spec = DivergenceSpec(
        beta=_beta(beta),
        temperature=_positive("temperature", temperature),
        student_scale=_finite("student_logit_scale", student_logit_scale),
        teacher_scale=_finite("teacher_logit_scale", teacher_logit_scale),
        student_softcap=_softcap("student_softcap", student_softcap),
        teacher_softcap=_softcap("teacher_softcap", teacher_softcap),
    )
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; valid: {', '.join(REDUCTIONS)}")
    if isinstance(student_hidden, torch.Tensor) and isinstance(teacher_hidden, torch.Tensor):
        # each model's operands as its lm_head call would take them under autocast
        student_hidden, student_weight, student_bias = _autocast(
            student_hidden, student_weight, student_bias)
        teacher_hidden, teacher_weight, teacher_bias = _autocast(
            teacher_hidden, teacher_weight, teacher_bias)
    _check_model("student", student_hidden, student_weight, student_bias)
    _check_model("teacher", teacher_hidden, teacher_weight, teacher_bias)
    raise_if_capturing(student_hidden.device, "fused_linear_jsd")  # it reads counts on the host
    if student_weight.shape[0] == 0:
        raise ValueError("student_weight has 0 rows: the vocabulary is empty")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"student and teacher vocabulary sizes differ: student_weight has "
            f"{student_weight.shape[0]} rows, teacher_weight {teacher_weight.shape[0]}")
    lead = student_hidden.shape[:-1]
    if teacher_hidden.shape[:-1] != lead:
        raise ValueError(
            f"student_hidden {tuple(student_hidden.shape)} and teacher_hidden "
            f"{tuple(teacher_hidden.shape)} must have the same leading shape")
    if teacher_hidden.device != student_hidden.device:
        raise ValueError(f"student tensors are on {student_hidden.device}, teacher's on "
                         f"{teacher_hidden.device}")
    if student_hidden.dim() not in (2, 3):
        raise ValueError(f"student_hidden must be [N, H] or [B, T, H], got "
                         f"{tuple(student_hidden.shape)}")
    if logits_budget is not None and (isinstance(logits_budget, bool)
                                      or not isinstance(logits_budget, numbers.Integral)
                                      or logits_budget < 0):
        raise ValueError(f"logits_budget must be None or an int >= 0 (bytes), got "
                         f"{logits_budget!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")

    n = lead.numel()
    device = student_hidden.device
    if labels is None:
        valid_rows = torch.arange(n, device=device)
        n_valid = n
    else:
        if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point \
                or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise TypeError(f"labels must be an integer tensor, got "
                            f"{getattr(labels, 'dtype', type(labels).__name__)}")
        if labels.shape != lead:
            raise ValueError(f"labels shape {tuple(labels.shape)} does not match the hidden "
                             f"states' leading shape {tuple(lead)}")
        mask = labels.reshape(-1).to(device) != ignore_index
        valid_rows = mask.nonzero().squeeze(1)
        n_valid = int(valid_rows.shape[0])

    per_row = reduction == "none" and num_items_in_batch is None
    if per_row:
        scale = 1.0
    elif num_items_in_batch is not None:
        wide = torch.float64 in (student_weight.dtype, teacher_weight.dtype)
        scale = _reciprocal(num_items_in_batch, device,
                            torch.float64 if wide else torch.float32)
    elif reduction == "batchmean":
        scale = 1.0 / (max(n_valid, 1) if labels is not None else max(student_hidden.shape[0], 1))
    elif reduction == "sum":
        scale = 1.0
    else:  # mean over TRL's [counted positions, V] elements: 0/0 = NaN when none is counted
        count = n_valid * student_weight.shape[0]
        scale = 1.0 / count if count else math.nan
    with torch.autocast(device.type, enabled=False):  # float32 products, as documented
        d, entropy = run_divergence(
            student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
            teacher_bias, valid_rows, n_valid, spec, per_row, return_student_entropy,
            logits_budget, backend, scale)
    loss = d.view(lead) if per_row else d
    if return_student_entropy:
        return loss, entropy.view(lead)
    return loss


def _reciprocal(num_items, device, dtype=torch.float32):
    """``1 / num_items_in_batch``: a Python float, or a 0-d ``dtype`` tensor on ``device`` (a
    tensor's value is not read on the host; float64 for a float64 loss)."""
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise ValueError(f"num_items_in_batch must have one element, got shape "
                             f"{tuple(num_items.shape)}")
        if num_items.requires_grad and torch.is_grad_enabled():
            raise ValueError(NUM_ITEMS_GRAD_MESSAGE)
        return 1.0 / num_items.to(device=device, dtype=dtype).reshape(())
    v = _number("num_items_in_batch", num_items)
    return 1.0 / v if v else math.inf


def _number(name, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _beta(beta) -> float:
    b = _number("beta", beta)
    if not 0.0 <= b <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return b


def _positive(name, value) -> float:
    v = _number(name, value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return v


def _finite(name, value) -> float:
    v = _number(name, value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value}")
    return v


def _softcap(name, value):
    if value is None:
        return None
    return _positive(name, value)


def _check_model(who, hidden, weight, bias):
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{who}_hidden and {who}_weight must be tensors")
    if hidden.dtype not in _FLOATS:
        raise TypeError(f"{who}_hidden must be a floating tensor, got {hidden.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{who}_weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{who}_hidden's last dimension ({hidden.shape[-1] if hidden.dim() else None}) "
            f"does not match {who}_weight's hidden size ({weight.shape[1]})")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{who}_hidden is {hidden.dtype} but {who}_weight is {weight.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"{who}_hidden is on {hidden.device} but {who}_weight on "
                         f"{weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],):
            raise ValueError(f"{who}_bias must be a [V] = [{weight.shape[0]}] tensor, got "
                             f"{getattr(bias, 'shape', type(bias).__name__)}")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise TypeError(f"{who}_bias must have {who}_weight's dtype and device")

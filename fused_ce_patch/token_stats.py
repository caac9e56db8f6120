"""Per-token outputs of the fused head: :func:`fused_linear_token_stats` (docs/design.md).

What trainers beyond plain SFT consume (TRL's DPO, KTO, GRPO, RLOO and its fused LM head): the
log-probability of each label, and on request the entropy of each row's distribution and
whether the label is the argmax, all without the ``[tokens, vocab]`` logits.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import torch

from . import backends, tile_policy
from .backends.token_stats import DEFAULT_BUDGET as TILES_DEFAULT_BUDGET
from .backends.token_stats import Transform, token_stats_chunked, token_stats_reference
from .loss import (
    _autocast,
    _check_ignore_index,
    _check_labels,
    _check_real_tensors,
    _check_shift,
    _check_tensors,
    _is_number,
    _number_error,
    _shift,
    check_logits_budget,
)
from .tile_policy import ReplacedTiling


@dataclasses.dataclass
class ForwardGradHint:
    """Lets :func:`fused_linear_token_stats` form its gradient in the forward pass.

    Pass one instance on every call of one training loop whose loss is a mean or sum of the
    ``log_probs`` (the same upstream gradient on every counted position, none on the
    entropy), as SFT's is. On backend ``"triton"`` the forward then also forms the gradient
    (3 matmuls per chunk instead of 4, the loss's schedule); the backward checks, with one
    host sync, that its upstream gradient is indeed one value, and scales. If it is not (a
    per-token weight, an entropy term), that call recomputes its gradient exactly and
    :attr:`on` turns False, so later calls with this hint recompute directly. Results are
    equal in exact arithmetic (identical in float32; in bfloat16 the two roundings differ,
    equally far from float64); only the time differs. float16 inputs always recompute, and
    calls without grad mode never form a gradient.

    Attributes:
        on: whether the next forward forms the gradient (set False by a mismatch).
    """

    on: bool = True


class TokenStats(NamedTuple):
    """Per-token results, each with the labels' shape; 0 (False) at ignored positions.

    Attributes:
        log_probs: float32 (float64 for float64 inputs) ``log p(label)`` = minus the
            per-token cross-entropy.
        entropy: same dtype, ``-sum_v p_v log p_v``, or None when not requested.
        is_top1: bool, label is the (first) argmax of the logits, or None when not requested.
        mask: bool, the position was counted (label != ignore_index).
        mean_logits: ``mean_v z_v`` (no gradient), or None when not requested.
        log_sum_sq_probs: ``log sum_v p_v^2`` (no gradient), or None when not requested.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None
    mask: torch.Tensor
    mean_logits: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None


def fused_linear_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
    entropy: bool = False,
    accuracy: bool = False,
    mean_logits: bool = False,
    log_sum_sq_probs: bool = False,
    logits_budget: int | None = None,
    backend: str = "auto",
    grad_hint: ForwardGradHint | None = None,
    replaces: ReplacedTiling | None = None,
) -> TokenStats:
    """Per-token log-probabilities (and optionally entropy and top-1 hits) of
    ``hidden @ weight.T (+ bias)`` without storing the ``[N, V]`` logits.

    With logits ``x = h W^T + b``, the distribution of each position is ``softmax(z)`` over::

        z = c * tanh(s * x / c) / t        (softcap c; without it z = s * x / t)

    where ``s`` is ``logit_scale`` (a model's logit multiplier) and ``t`` the sampling
    ``temperature`` (TRL divides by it after the softcap). Per counted position (label ``y``
    != ``ignore_index``)::

        log_probs = z_y - LSE(z)              (= -loss with reduction "none")
        entropy   = LSE(z) - sum_v p_v z_v
        is_top1   = argmax_v z_v == y         (first maximum, like torch.argmax)

    Gradients flow to ``hidden``, ``weight`` and ``bias`` from ``log_probs`` with any
    per-position upstream gradient (GRPO / DPO weights), and from ``entropy`` (entropy
    bonuses) when it was requested; ``is_top1`` has none. Ignored positions get 0 / False and
    no gradient. Accumulation is float32 (float64 for float64 inputs).

    Args:
        hidden: ``[..., H]`` float16, bfloat16, float32 or float64.
        weight: ``[V, H]`` lm_head weight, same dtype and device (under ``torch.autocast``
            both are cast as ``lm_head(hidden)`` would be).
        labels: ``[...]`` = ``hidden.shape[:-1]`` int64 or int32 labels in ``[0, V)`` or
            ``ignore_index``.
        bias: ``[V]`` or None.
        ignore_index: label of positions that are not scored.
        shift: causal shift (position t scores ``labels[..., t + 1]``; the last position of
            each sequence is ignored).
        softcap: ``c > 0`` or None. logit_scale: ``s`` (finite, != 0). temperature: ``t > 0``.
        entropy: also return the entropy (differentiable).
        accuracy: also return ``is_top1``.
        mean_logits, log_sum_sq_probs: also return ``mean_v z_v`` / ``log sum_v p_v^2`` (the
            fields TRL's DPO logs and its WPO weighting uses; no gradient).
        logits_budget: bytes of transient logits a chunk may hold; the peak extra memory
            follows it, not ``N * V``. None: the backend's default (backend ``"triton"``: the
            loss's, 248 MiB per 8192 counted rows, at most 496 MiB; the torch tiles: 256 MiB),
            capped by the logits tile of the computation this call replaces
            (:func:`fused_ce_patch.tile_policy.logits_budget`; see ``replaces``).
        backend: any name ``fused_linear_cross_entropy`` accepts. ``"reference"``
            materialises the logits in float32 (float64) and uses autograd — the oracle.
            ``"triton"`` (the CUDA default) runs cuBLAS logits chunks and one Triton row
            kernel (:mod:`fused_ce_patch.backends.triton.token_stats`); it falls back to the
            tiles below for float64 or when fewer than 16 rows fit the budget. Every other
            name (after the same availability check as the loss, so a backend that cannot
            run here raises the same error) runs the tiled torch algorithm of
            :mod:`fused_ce_patch.backends.token_stats`, whose matmuls use the device's BLAS
            (CANN, CPU); on CUDA its per-tile element-wise math is fused by
            ``torch.compile`` (``$FUSED_CE_TOKEN_STATS_COMPILE=0`` turns that off).
        grad_hint: a :class:`ForwardGradHint` shared by the calls of one training loop whose
            loss is a mean or sum of ``log_probs``: saves one matmul per chunk on backend
            ``"triton"`` (see the class). None: the gradient is formed in backward.
        replaces: the computation this call stands in for
            (:class:`~fused_ce_patch.tile_policy.ReplacedTiling`); with ``logits_budget=None``
            the call holds at most the bytes of that computation's logits tile for the
            counted rows. None: TRL's fused LM head
            (:data:`~fused_ce_patch.tile_policy.TRL_LOGPROB`, ``[min(M, 4096), min(V, 32768)]``
            logits in the compute dtype).

    Returns:
        :class:`TokenStats` ``(log_probs, entropy, is_top1, mask, mean_logits,
        log_sum_sq_probs)``, each ``labels``-shaped.

    Raises:
        ValueError: label out of range (names it and V), shape mismatch (names both), unknown
            backend, bad ``softcap`` / ``logit_scale`` / ``temperature`` / ``logits_budget``,
            a meta-device (data-less) tensor.
        TypeError: dtype mismatch outside autocast, labels not int64/int32, a ``grad_hint``
            that is not a :class:`ForwardGradHint`, an ``entropy`` / ``accuracy`` /
            ``mean_logits`` / ``log_sum_sq_probs`` that is not a bool (``"no"`` is truthy), a
            ``replaces`` that is not a :class:`~fused_ce_patch.tile_policy.ReplacedTiling`.
        BackendUnavailableError: the requested backend cannot run here.
        RuntimeError: called while a CUDA graph is being captured (the label check reads
            the host).

    Source: the blockwise log-sum-exp of Wijmans et al., "Cut Your Losses in Large-Vocabulary
    Language Models" (2024); field names and the temperature convention of TRL's fused LM
    head (``trl.trainer.utils.add_fused_lm_head``, trl 1.16).
    """
    _check_options(softcap, logit_scale, temperature, logits_budget, backend)
    for name, value in (("entropy", entropy), ("accuracy", accuracy),
                        ("mean_logits", mean_logits), ("log_sum_sq_probs", log_sum_sq_probs)):
        if not isinstance(value, bool):  # "no" is truthy: it would compute the field
            raise TypeError(f"{name} must be True or False, got {type(value).__name__} "
                            f"{value!r}")
    if grad_hint is not None and not isinstance(grad_hint, ForwardGradHint):
        raise TypeError(f"grad_hint must be None or a ForwardGradHint, got "
                        f"{type(grad_hint).__name__}")
    if replaces is not None and not isinstance(replaces, ReplacedTiling):
        raise TypeError(f"replaces must be None or a ReplacedTiling, got "
                        f"{type(replaces).__name__}")
    ignore_index = _check_ignore_index(ignore_index)
    _check_shift(shift)
    _check_real_tensors(hidden, weight, labels, bias)  # before autocast, which rejects meta
    hidden, weight, bias = _autocast(hidden, weight, bias)
    _check_tensors(hidden, weight, labels, bias)
    if labels.dtype != torch.int64:
        labels = labels.long()
    if shift:
        labels = _shift(labels, ignore_index)
    flat = labels.reshape(-1)
    valid_rows, n_valid = _check_labels(flat, weight.shape[0], ignore_index)
    chosen = backends.resolve(backend, hidden.device, hidden.dtype)  # the loss's errors
    transform = Transform(float(logit_scale), None if softcap is None else float(softcap),
                          float(temperature))

    h = hidden.reshape(-1, hidden.shape[-1])
    all_rows = n_valid == flat.shape[0]
    if not all_rows:
        h = h.index_select(0, valid_rows)
    y = flat if all_rows else flat.index_select(0, valid_rows)
    extras = {name for name, on in (("entropy", entropy), ("is_top1", accuracy),
                                    ("mean_logits", mean_logits),
                                    ("log_sum_sq_probs", log_sum_sq_probs)) if on}
    with torch.autocast(hidden.device.type, enabled=False):
        out = None
        if backend == "reference":
            out = token_stats_reference(h, weight, bias, y, transform, extras)
        elif chosen.name == "triton" and hidden.dtype != torch.float64:
            from .backends.triton import default_budget
            from .backends.triton.token_stats import token_stats_triton

            budget = logits_budget
            if budget is None:
                speed = default_budget(h.shape[0], weight.shape[0], h.shape[1],
                                       h.element_size(), h.device)
                budget = _default_budget(h, weight, replaces, speed)
            out = token_stats_triton(h, weight, bias, y, transform, extras, budget, grad_hint)
        if out is None:  # also when too few rows fit the budget for the Triton chunks
            budget = logits_budget
            if budget is None:
                budget = _default_budget(h, weight, replaces, TILES_DEFAULT_BUDGET)
            out = token_stats_chunked(h, weight, bias, y, transform, extras, budget)
    lp, ent, top1, mean_z, log_sq = out
    mask = flat != ignore_index

    def scatter(x):
        if x is None:
            return None
        if not all_rows:
            # index_put keeps the result connected to autograd even with zero counted rows
            x = x.new_zeros(flat.shape).index_put((valid_rows,), x)
        return x.view(labels.shape)

    return TokenStats(scatter(lp), scatter(ent), scatter(top1), mask.view(labels.shape),
                      scatter(mean_z), scatter(log_sq))


def _default_budget(h, weight, replaces, backend_default):
    # never more transient logits than the path replaced holds for these rows (tile_policy)
    return tile_policy.logits_budget(h.shape[0], weight.shape[0], h.dtype,
                                     replaces or tile_policy.TRL_LOGPROB, backend_default)


def _check_options(softcap, logit_scale, temperature, budget, backend):
    # Types as fused_linear_cross_entropy checks them: a bool is never a number here.
    for name, value in (("softcap", softcap), ("logit_scale", logit_scale),
                        ("temperature", temperature)):
        if not (value is None and name == "softcap") and not _is_number(value, numbers.Real):
            raise _number_error(name, value, "a real number")
    check_logits_budget(budget)
    if backend not in backends.backend_names():
        raise ValueError(
            f"unknown backend {backend!r}; valid: {', '.join(backends.backend_names())}"
        )
    if softcap is not None and not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap}")
    if not (math.isfinite(logit_scale) and logit_scale != 0):
        raise ValueError(f"logit_scale must be a finite non-zero number, got {logit_scale}")
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")

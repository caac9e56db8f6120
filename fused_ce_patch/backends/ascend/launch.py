"""Host-side launches of the ascend kernels, with the blocks and grids of a
:class:`~.config.LaunchConfig`.

No ``num_warps`` / ``num_stages``: triton-ascend has no warps to tune (flash-linear-attention's
Ascend notes); the interpreter ignores them anyway.
"""

from __future__ import annotations

import os

import torch

from ..base import LossSpec
from ..triton.launch import scale_args
from .config import LaunchConfig
from .kernels import (
    dhidden_dweight_tiles_kernel,
    dhidden_rows_kernel,
    lse_forward_tiles_kernel,
    logits_grad_rows_kernel,
    target_dweight_runs_kernel,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _bf16_interpreted(dtype: torch.dtype) -> bool:
    """bfloat16 in the interpreter: its ``tl.dot`` and its casts to bfloat16 need the
    workarounds ``DOT_F32`` / ``RNE_BF16`` (kernels module docstring)."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_logits_grad(cfg: LaunchConfig, z, labels, lse, loss, coef, scale, spec: LossSpec, *,
                       compute_lse: bool, write_grad: bool):  # fmt: skip
    """Run :func:`~.kernels.logits_grad_rows_kernel` over the ``[r, V]`` chunk ``z``.

    ``labels`` ``[r]`` int64; ``lse``, ``loss``, ``coef`` ``[r]`` float32 (``loss``/``coef``
    may be None when not written); ``scale`` a float, a 0-d or an ``[r]`` float32 tensor.
    """
    r, vocab = z.shape
    if r == 0:
        return
    mode, scale_t, scale_v = scale_args(scale if write_grad else 1.0, z.device)
    logits_grad_rows_kernel[(min(cfg.chip.vectorcores, r),)](
        z, z.stride(0), labels, lse,
        loss if loss is not None else lse,
        coef if coef is not None else lse,
        scale_t, scale_v, r, vocab,
        float(spec.softcap or 1.0), float(spec.label_smoothing), float(spec.z_loss),
        HAS_SOFTCAP=spec.softcap is not None,
        SMOOTHING=spec.label_smoothing != 0.0,
        Z_LOSS=spec.z_loss != 0.0,
        SCALE_MODE=mode,
        COMPUTE_LSE=compute_lse,
        WRITE_GRAD=write_grad,
        BLOCK_V=cfg.rows.block,
        RNE_BF16=_bf16_interpreted(z.dtype),
    )  # fmt: skip


def launch_dhidden_rows(cfg: LaunchConfig, dh, out_rows, *, part=None, coef=None, labels=None,
                        weight=None, accumulate=False):  # fmt: skip
    """``dH[out_rows] (+)= part + coef * W[labels]`` (:func:`~.kernels.dhidden_rows_kernel`)."""
    r = out_rows.shape[0]
    if r == 0:
        return
    w = weight if weight is not None else dh
    dhidden_rows_kernel[(min(cfg.chip.vectorcores, r),)](
        dh, dh.stride(0),
        part if part is not None else dh,
        part.stride(0) if part is not None else 0,
        out_rows,
        coef if coef is not None else out_rows,
        labels if labels is not None else out_rows,
        w, w.stride(0), w.stride(1),
        r, dh.shape[1],
        HAS_PART=part is not None,
        ADD_TARGET=coef is not None,
        ACCUMULATE=accumulate,
        BLOCK_H=cfg.rowwise.block,
        RNE_BF16=_bf16_interpreted(dh.dtype),
    )  # fmt: skip


def launch_target_dweight(cfg: LaunchConfig, dw, db, labels, coef, hidden, row_off):
    """Add the target part of dW (``[V, H]``) and db (float32 ``[V]``) for all counted rows
    (:func:`~.kernels.target_dweight_runs_kernel`); ``labels``, ``coef``, ``row_off`` ``[M]``.

    Sorting the labels and finding the runs of equal labels reads one count back to the host
    (the number of distinct labels, which sizes the launch).
    """
    m = labels.shape[0]
    if m == 0 or (dw is None and db is None):
        return
    sorted_labels, order = torch.sort(labels, stable=True)
    run_labels, counts = torch.unique_consecutive(sorted_labels, return_counts=True)
    starts = torch.zeros(counts.shape[0] + 1, dtype=torch.int64, device=labels.device)
    torch.cumsum(counts, 0, out=starts[1:])
    n_runs = run_labels.shape[0]
    target_dweight_runs_kernel[(min(cfg.chip.vectorcores, n_runs),)](
        dw if dw is not None else coef,
        dw.stride(0) if dw is not None else 0,
        db if db is not None else coef,
        run_labels, starts, order, coef,
        hidden, row_off, hidden.stride(-1),
        n_runs, hidden.shape[-1],
        NEED_W=dw is not None,
        NEED_B=db is not None,
        BLOCK_H=cfg.rowwise.block,
        RNE_BF16=dw is not None and _bf16_interpreted(dw.dtype),
    )  # fmt: skip


def launch_lse_forward(cfg: LaunchConfig, hidden, row_off, weight, bias, labels, spec: LossSpec):
    """Partial statistics ``[4, splits, M]`` (float32) of :func:`~.kernels.lse_forward_tiles_kernel`
    for the ``M`` counted rows at ``row_off`` (``M >= 1``)."""
    m = labels.shape[0]
    vocab, hsize = weight.shape
    plan = cfg.forward
    per_split = _cdiv(_cdiv(vocab, plan.splits), plan.block_n) * plan.block_n
    splits = _cdiv(vocab, per_split)
    part = torch.empty(4, splits, m, dtype=torch.float32, device=hidden.device)
    tasks = _cdiv(m, plan.block_m) * splits
    lse_forward_tiles_kernel[(min(cfg.chip.aicores, tasks),)](
        hidden, row_off, hidden.stride(-1),
        weight, weight.stride(0), weight.stride(1),
        bias if bias is not None else weight,
        labels, part, m, vocab, hsize, splits, per_split,
        float(spec.softcap or 1.0),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=spec.softcap is not None,
        SMOOTHING=spec.label_smoothing != 0.0,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        EVEN_K=hsize % plan.block_k == 0,
        DOT_F32=_bf16_interpreted(weight.dtype),
    )  # fmt: skip
    return part


def launch_dhidden_dweight(cfg: LaunchConfig, hidden, row_off, weight, bias, labels, lse, scale,
                           dh_acc, dw_acc, db, v_start: int, n_cols: int,
                           spec: LossSpec):  # fmt: skip
    """One group of :func:`~.kernels.dhidden_dweight_tiles_kernel`: ``r = len(labels)`` counted
    rows against the vocabulary columns ``[v_start, v_start + n_cols)``. ``dh_acc``
    (``[>= r, H]``), ``dw_acc`` (``[n_cols, H]``), ``db`` (``[V]``) are float32 or None."""
    r = labels.shape[0]
    vocab, hsize = weight.shape
    plan = cfg.backward
    mode, scale_t, scale_v = scale_args(scale, hidden.device)
    dummy = lse
    tasks = _cdiv(r, plan.block_m) * _cdiv(n_cols, plan.block_n)
    dhidden_dweight_tiles_kernel[(min(cfg.chip.aicores, tasks),)](
        hidden, row_off, hidden.stride(-1),
        weight, weight.stride(0), weight.stride(1),
        bias if bias is not None else weight,
        labels, lse, scale_t, scale_v,
        dh_acc if dh_acc is not None else dummy,
        dw_acc if dw_acc is not None else dummy,
        db if db is not None else dummy,
        r, v_start, n_cols, vocab, hsize,
        float(spec.softcap or 1.0), float(spec.label_smoothing), float(spec.z_loss),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=spec.softcap is not None,
        SMOOTHING=spec.label_smoothing != 0.0,
        Z_LOSS=spec.z_loss != 0.0,
        SCALE_MODE=mode,
        NEED_H=dh_acc is not None,
        NEED_W=dw_acc is not None,
        NEED_B=db is not None,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        BLOCK_H=plan.block_h,
        EVEN_K=hsize % plan.block_k == 0,
        DOT_F32=_bf16_interpreted(weight.dtype),
        RNE_BF16=_bf16_interpreted(weight.dtype),
    )  # fmt: skip

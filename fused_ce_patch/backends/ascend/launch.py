"""The ascend kernels behind the ``triton`` backend's drivers: :class:`AscendLaunchers`, the
:class:`~fused_ce_patch.backends.triton.launch.Launchers` of backend ``"ascend"``, launches
them with the blocks and grids of a :class:`~.config.LaunchConfig`.

The drivers (``triton/chunked_path.py``, ``triton/zero_logits.py``) are shared: matmuls,
chunking, accumulators and roundings are the same on both backends; only these launches
differ. No ``num_warps`` / ``num_stages``: triton-ascend has no warps to tune
(flash-linear-attention's Ascend notes); the interpreter ignores them anyway.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..triton.launch import scale_args, triton_cdiv
from .config import LaunchConfig
from .kernels import (
    dhidden_dweight_tiles_kernel,
    dhidden_rows_kernel,
    logits_grad_rows_kernel,
    lse_forward_tiles_kernel,
    target_dweight_runs_kernel,
)


def _bf16_interpreted(dtype: torch.dtype) -> bool:
    """bfloat16 in the interpreter: its ``tl.dot`` and its casts to bfloat16 need the
    workarounds ``DOT_F32`` / ``RNE_BF16`` (kernels module docstring)."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"


class LabelRuns(NamedTuple):
    """Counted rows grouped by label, for :func:`~.kernels.target_dweight_runs_kernel`: run
    ``k`` (label ``labels[k]``) is the sorted positions ``[starts[k], starts[k + 1])``, and
    ``order[j]`` the row at sorted position ``j``."""

    order: torch.Tensor
    labels: torch.Tensor
    starts: torch.Tensor


@dataclass(frozen=True)
class AscendLaunchers:
    """The ascend kernels with the launch of one problem (``cfg``); see the
    :class:`~fused_ce_patch.backends.triton.launch.Launchers` protocol for each method."""

    cfg: LaunchConfig

    def logits_grad(self, z, labels, lse, nll, loss, coef, scale, spec, *, compute_lse,
                    write_grad):  # fmt: skip
        """:func:`~.kernels.logits_grad_rows_kernel` over the ``[r, V]`` chunk ``z``."""
        r, vocab = z.shape
        if r == 0:
            return
        mode, scale_t, scale_v = scale_args(scale if write_grad else 1.0, z.device)
        logits_grad_rows_kernel[(min(self.cfg.chip.vectorcores, r),)](
            z, z.stride(0), labels, lse, nll,
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
            BLOCK_V=self.cfg.rows.block,
            RNE_BF16=_bf16_interpreted(z.dtype),
        )  # fmt: skip

    def dhidden_rows(self, dh, out_rows, *, part=None, coef=None, labels=None, weight=None,
                     accumulate=False):  # fmt: skip
        """:func:`~.kernels.dhidden_rows_kernel`."""
        r = out_rows.shape[0]
        if r == 0:
            return
        w = weight if weight is not None else dh
        dhidden_rows_kernel[(min(self.cfg.chip.vectorcores, r),)](
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
            BLOCK_H=self.cfg.rowwise.block,
            RNE_BF16=_bf16_interpreted(dh.dtype),
        )  # fmt: skip

    def sort_by_label(self, labels) -> LabelRuns:
        """The runs of equal labels; reads one count back to the host (the number of
        distinct labels, which sizes the launch)."""
        sorted_labels, order = torch.sort(labels, stable=True)
        run_labels, counts = torch.unique_consecutive(sorted_labels, return_counts=True)
        starts = torch.zeros(counts.shape[0] + 1, dtype=torch.int64, device=labels.device)
        torch.cumsum(counts, 0, out=starts[1:])
        return LabelRuns(order, run_labels, starts)

    def target_dweight(self, dw, db, labels, coef, hidden, row_off, *, v_lo=0, v_hi=None,
                       by_label=None):  # fmt: skip
        """:func:`~.kernels.target_dweight_runs_kernel` over the runs of equal labels (found
        here, with :meth:`sort_by_label`'s host sync, when ``by_label`` is None)."""
        if labels.shape[0] == 0 or (dw is None and db is None):
            return
        runs = by_label if by_label is not None else self.sort_by_label(labels)
        n_runs = runs.labels.shape[0]
        target_dweight_runs_kernel[(min(self.cfg.chip.vectorcores, n_runs),)](
            dw if dw is not None else coef,
            dw.stride(0) if dw is not None else 0,
            db if db is not None else coef,
            runs.labels, runs.starts, runs.order, coef,
            hidden, row_off, hidden.stride(-1),
            n_runs, hidden.shape[-1],
            v_lo, v_hi if v_hi is not None else 2**31 - 1,
            NEED_W=dw is not None,
            NEED_B=db is not None,
            BLOCK_H=self.cfg.rowwise.block,
            RNE_BF16=dw is not None and _bf16_interpreted(dw.dtype),
        )  # fmt: skip

    def lse_forward_partials(self, hidden, row_off, weight, bias, labels, spec):
        """:func:`~.kernels.lse_forward_tiles_kernel` with ``cfg.forward``'s splits."""
        m = labels.shape[0]
        vocab, hsize = weight.shape
        plan = self.cfg.forward
        per_split = triton_cdiv(triton_cdiv(vocab, plan.splits), plan.block_n) * plan.block_n
        splits = triton_cdiv(vocab, per_split)
        part = torch.empty(4, splits, m, dtype=torch.float32, device=hidden.device)
        tasks = triton_cdiv(m, plan.block_m) * splits
        lse_forward_tiles_kernel[(min(self.cfg.chip.aicores, tasks),)](
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

    def backward_block_m(self, weight):
        return self.cfg.backward.block_m

    def dhidden_dweight_backward(self, hidden, row_off, weight, bias, labels, lse, scale,
                                 dh_acc, dw_acc, db, v_start, n_cols, spec):  # fmt: skip
        """:func:`~.kernels.dhidden_dweight_tiles_kernel` for one group of rows."""
        r = labels.shape[0]
        vocab, hsize = weight.shape
        plan = self.cfg.backward
        mode, scale_t, scale_v = scale_args(scale, hidden.device)
        dummy = lse
        tasks = triton_cdiv(r, plan.block_m) * triton_cdiv(n_cols, plan.block_n)
        dhidden_dweight_tiles_kernel[(min(self.cfg.chip.aicores, tasks),)](
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

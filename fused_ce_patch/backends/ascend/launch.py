"""The ``triton`` backend's kernels launched for the NPU: :class:`AscendLaunchers`, the
:class:`~fused_ce_patch.backends.triton.launch.Launchers` of backend ``"ascend"``, runs
``backends/triton/kernels.py`` with persistent grids, the blocks of a
:class:`~.config.LaunchConfig` and the device switches triton-ascend needs (that module's
docstring lists them and why).

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

from ..triton.kernels import target_dweight_runs_kernel
from ..triton.launch import (
    launch_dhidden_dweight_backward,
    launch_dhidden_rows,
    launch_lse_forward,
    launch_logits_grad,
    triton_cdiv,
)
from .config import LaunchConfig


def _interpreted() -> bool:
    """Under the interpreter: ``tl.dot`` and casts to bfloat16 need the workarounds ``UPCAST``
    / ``FIX_RNE`` (kernels module docstring); off on the NPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: The kernels' device switches on triton-ascend (``backends/triton/kernels.py`` docstring).
_NPU = dict(PERSISTENT=True)
_NPU_ROWS = dict(_NPU, LANE_SUMS=False, NUM_STAGES=1)
_NPU_TILES = dict(_NPU, DOT_PRECISION="ieee", ROW_ALIGN=1)
_NPU_ATOMICS = dict(FRESH_OPERANDS=True, ATOMIC_SEM="acq_rel")


class LabelRuns(NamedTuple):
    """Counted rows grouped by label, for ``target_dweight_runs_kernel``: run
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
        """``logits_grad_inplace_kernel`` over the ``[r, V]`` chunk ``z``."""
        r = z.shape[0]
        if r == 0:
            return
        launch_logits_grad(
            (min(self.cfg.chip.vectorcores, r),), z, labels, lse, nll, loss, coef, scale, spec,
            compute_lse=compute_lse, write_grad=write_grad, BLOCK_V=self.cfg.rows.block,
            FIX_RNE=_interpreted(), **_NPU_ROWS,
        )  # fmt: skip

    def scale_unless_one(self, tensors, g):
        """On the host (one synchronisation): the device-side kernel of the CUDA launchers
        has not been run on triton-ascend."""
        value = g.item()
        if value != 1.0:
            for t in tensors:
                if t is not None:
                    t.mul_(value)

    def dhidden_rows(self, dh, out_rows, *, part=None, coef=None, labels=None, weight=None,
                     accumulate=False):  # fmt: skip
        """``dhidden_rows_store_kernel``."""
        r = out_rows.shape[0]
        if r == 0:
            return
        launch_dhidden_rows(
            (min(self.cfg.chip.vectorcores, r),), dh, out_rows, part, coef, labels, weight,
            accumulate, BLOCK_H=self.cfg.rowwise.block, FIX_RNE=_interpreted(), **_NPU,
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
        """``target_dweight_runs_kernel`` over the runs of equal labels (found
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
            FIX_RNE=_interpreted(),
        )  # fmt: skip

    def lse_forward_partials(self, hidden, row_off, weight, bias, labels, spec):
        """``lse_forward_kernel`` with ``cfg.forward``'s splits."""
        m = labels.shape[0]
        vocab = weight.shape[0]
        plan = self.cfg.forward
        per_split = triton_cdiv(triton_cdiv(vocab, plan.splits), plan.block_n) * plan.block_n
        splits = triton_cdiv(vocab, per_split)
        part = torch.empty(4, splits, m, dtype=torch.float32, device=hidden.device)
        tasks = triton_cdiv(m, plan.block_m) * splits
        launch_lse_forward(
            (min(self.cfg.chip.aicores, tasks),), hidden, row_off, weight, bias, labels, part,
            per_split, spec, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
            UPCAST=_interpreted(), **_NPU_TILES,
        )  # fmt: skip
        return part

    def backward_block_m(self, weight):
        return self.cfg.backward.block_m

    def dhidden_dweight_backward(self, hidden, row_off, weight, bias, labels, lse, scale,
                                 dh_acc, dw_acc, db, v_start, n_cols, spec):  # fmt: skip
        """``dhidden_dweight_backward_kernel`` for one group of rows."""
        plan = self.cfg.backward
        tasks = triton_cdiv(labels.shape[0], plan.block_m) * triton_cdiv(n_cols, plan.block_n)
        launch_dhidden_dweight_backward(
            (min(self.cfg.chip.aicores, tasks),), hidden, row_off, weight, bias, labels, lse,
            scale, dh_acc, dw_acc, db, v_start, n_cols, spec,
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
            BLOCK_H=plan.block_h, UPCAST=_interpreted(), FIX_RNE=_interpreted(),
            **_NPU_TILES, **_NPU_ATOMICS,
        )  # fmt: skip

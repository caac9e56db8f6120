"""Zero-logits path of backend ``"ascend"`` (``logits_budget=0``): no logits in device memory.

The algorithm of the ``triton`` backend's zero-logits path (see its module docstring), with
the ascend kernels: the forward (:func:`~.kernels.lse_forward_tiles_kernel`) keeps per-split
running statistics of logit tiles that live on chip only, combined by a few torch ops into one
float32 LSE and one loss per counted row; the backward
(:func:`~.kernels.dhidden_dweight_tiles_kernel`) recomputes each tile and adds its products
into float32 accumulators, and the target column is added exactly at the end. Gradients are
exact (no filtering).

Memory beyond dH and dW follows the ``triton`` backend: dW of 16-bit weights is accumulated in
float32 inside its own storage, one vocabulary group at a time (its ``_vocab_groups`` /
``_round_into``, reused here), and dH in a float32 buffer of at most
``DH_GROUP_BYTES`` per group of rows. One difference: the target part of dH is added to the
float32 sum of the last vocabulary group before it is rounded into dH, so with 16-bit inputs
dH is rounded once per vocabulary group rather than once more at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import single_backward
from ..base import LossSpec
from ..chunked import finish_loss
from ..triton.launch import row_offsets
from ..triton.zero_logits import _round_into, _vocab_groups
from .config import LaunchConfig
from .launch import (
    launch_dhidden_dweight,
    launch_dhidden_rows,
    launch_lse_forward,
    launch_target_dweight,
)

#: float32 accumulator of dH for one group of rows (bytes).
DH_GROUP_BYTES = 4 * 2**20


@dataclass
class ZeroLogitsConfig:
    spec: LossSpec
    reduction: str  # "none" | "sum"
    scale: float | torch.Tensor
    n_valid: int
    launch: LaunchConfig


def lse_forward(cfg: LaunchConfig, hidden, row_off, weight, bias, labels, spec: LossSpec):
    """Per counted row: ``(loss, lse, z_target)`` (float32 ``[M]``), logits never stored.

    Args:
        cfg: launch configuration for this problem.
        hidden: ``[..., H]`` hidden states (any strides); rows are read at ``row_off``.
        row_off: ``[M]`` int64 element offsets of the counted rows in ``hidden``.
        weight: ``[V, H]``; bias: ``[V]`` or None; labels: ``[M]`` int64 targets in [0, V).
    """
    m, vocab = labels.shape[0], weight.shape[0]
    if m == 0:
        empty = torch.empty(0, dtype=torch.float32, device=hidden.device)
        return empty, empty, empty
    part = launch_lse_forward(cfg, hidden, row_off, weight, bias, labels, spec)
    run_max, run_sum, z_t, z_s = part.unbind(0)
    top = run_max.amax(0)
    log_s = (run_sum * torch.exp(run_max - top)).sum(0).log()
    lse = top + log_s
    z_t = z_t.sum(0)
    # (max - z_t) + log(sum), not lse - z_t: exact for confident rows in float32
    return finish_loss(lse, z_t, z_s.sum(0), vocab, spec, nll=(top - z_t) + log_s), lse, z_t


class AscendZeroLogitsLinearCrossEntropy(torch.autograd.Function):
    """``apply(hidden, weight, bias, labels, valid_rows, cfg)`` → ``[N]`` float32 losses
    (``"none"``) or the 0-d ``scale * sum``. See the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid_rows, cfg: ZeroLogitsConfig):
        y_valid = labels.index_select(0, valid_rows)
        row_off = row_offsets(hidden, valid_rows)
        loss, lse, z_t = lse_forward(cfg.launch, hidden, row_off, weight, bias, y_valid,
                                     cfg.spec)  # fmt: skip
        ctx.cfg = cfg
        ctx.save_for_backward(hidden, weight, bias, valid_rows, y_valid, row_off, lse, z_t)
        if cfg.reduction == "none":
            out = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device)
            return out.index_copy_(0, valid_rows, loss)
        return loss.sum() * cfg.scale

    @staticmethod
    @single_backward
    def backward(ctx, grad_out):
        cfg: ZeroLogitsConfig = ctx.cfg
        spec, launch = cfg.spec, cfg.launch
        hidden, weight, bias, valid_rows, y_valid, row_off, lse, z_t = ctx.saved_tensors
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        m = cfg.n_valid
        vocab, hsize = weight.shape
        dev = hidden.device
        n = hidden.numel() // hsize

        dh = torch.zeros(n, hsize, dtype=hidden.dtype, device=dev) if need_h else None
        dw = None
        if need_w:
            dw = torch.empty(vocab, hsize, dtype=weight.dtype, device=dev)
            if dw.dtype == torch.float32:
                dw.zero_()
        db = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_b else None

        if cfg.reduction == "none":
            scale = grad_out.reshape(-1).to(torch.float32).index_select(0, valid_rows)
        else:
            scale = grad_out.to(torch.float32) * cfg.scale

        block_m = launch.backward.block_m
        group_rows = max(block_m, DH_GROUP_BYTES // (4 * hsize) // block_m * block_m)
        group_rows = min(group_rows, -(-max(m, 1) // block_m) * block_m)
        dh_acc = torch.empty(group_rows, hsize, dtype=torch.float32, device=dev) if need_h else None

        # The target column, known from the forward: coef_r = scale_r * dL/dz_{r, y_r} (fp32).
        row_scale = scale if scale.dim() == 1 else scale.expand(m)
        p_y = torch.exp(z_t - lse)
        if spec.z_loss:
            p_y = p_y * (1.0 + 2.0 * spec.z_loss * lse)
        coef = p_y - (1.0 - spec.label_smoothing) - spec.label_smoothing / vocab
        if spec.softcap is not None:
            coef = coef * (1.0 - (z_t / spec.softcap) ** 2)
        coef = (coef * row_scale).contiguous()

        groups = _vocab_groups(dw, vocab, hsize, dev)
        for k, (v_start, n_cols, acc, dst, in_place) in enumerate(groups):
            last = k == len(groups) - 1
            if acc is not None and dst is not None:
                acc.zero_()
            for g0 in range(0, m, group_rows):
                r = min(group_rows, m - g0)
                if need_h:
                    dh_acc[:r].zero_()
                launch_dhidden_dweight(
                    launch, hidden, row_off[g0 : g0 + r], weight, bias, y_valid[g0 : g0 + r],
                    lse[g0 : g0 + r], scale[g0 : g0 + r] if scale.dim() == 1 else scale,
                    dh_acc if need_h else None, acc, db if need_b else None,
                    v_start, n_cols, spec,
                )  # fmt: skip
                if need_h:
                    # With the last group, the target part joins the float32 sum, so dH is
                    # rounded once per group (once when the vocabulary is one group).
                    launch_dhidden_rows(
                        launch, dh, valid_rows[g0 : g0 + r], part=dh_acc[:r],
                        coef=coef[g0 : g0 + r] if last else None,
                        labels=y_valid[g0 : g0 + r] if last else None,
                        weight=weight, accumulate=True,
                    )  # fmt: skip
            if dst is not None:
                _round_into(dst, acc, in_place)

        if need_w or need_b:
            launch_target_dweight(launch, dw, db, y_valid, coef, hidden, row_off)
        return (
            None if dh is None else dh.view(hidden.shape),
            dw,
            None if db is None else db.to(bias.dtype),
            None,
            None,
            None,
        )

"""Chunked path of backend ``"ascend"`` (``logits_budget > 0``).

The algorithm of the ``triton`` backend's chunked path (see its module docstring), with the
ascend kernels and their :class:`~.config.LaunchConfig`. Per chunk of counted rows::

    z        = h_c @ W.T (+ b)                  torch_npu matmul (cube), input dtype, [r, V]
    z        = logits_grad_rows(z)              LSE, loss, dense scale * dL/dz over z
    dH[rows] = z @ W + coef * W[y]              matmul, then dhidden_rows adds the target part
    dW      += z.T @ h_c                        addmm into dW (input dtype)
    db      += z.sum(0)                         float32
and once at the end ``dW[y] += sum coef_r h_r`` (target part, float32, one rounding).

Schedules: *eager* (scalar reductions with gradients: gradients formed in forward, 3 matmuls)
and *recompute* (``reduction="none"``: forward keeps one LSE per counted row, backward
recomputes the logits and honours a per-row upstream gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import single_backward
from ..base import LossSpec
from ..chunked import RowSource
from ..triton.launch import row_offsets
from .config import LaunchConfig
from .launch import launch_dhidden_rows, launch_logits_grad, launch_target_dweight


@dataclass
class ChunkedConfig:
    """Non-tensor arguments of :class:`AscendChunkedLinearCrossEntropy`."""

    spec: LossSpec
    reduction: str  # "none" | "sum"
    scale: float | torch.Tensor
    n_valid: int
    rows: int  # counted rows per chunk
    eager: bool
    need: tuple[bool, bool, bool]
    launch: LaunchConfig


@dataclass
class _Grads:
    dh: torch.Tensor | None
    dw: torch.Tensor | None
    db: torch.Tensor | None


def _new_grads(hidden, weight, bias, need) -> _Grads:
    need_h, need_w, need_b = need
    n = hidden.numel() // hidden.shape[-1]
    dev = hidden.device
    return _Grads(
        dh=torch.zeros(n, hidden.shape[-1], dtype=hidden.dtype, device=dev) if need_h else None,
        dw=torch.zeros_like(weight, memory_format=torch.contiguous_format) if need_w else None,
        db=torch.zeros(weight.shape[0], dtype=torch.float32, device=dev)
        if (need_b and bias is not None)
        else None,
    )


def _logits(h, weight, bias):
    return torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())


def _chunks(cfg: ChunkedConfig, hidden, valid_rows, y_valid):
    """``(start, stop, idx, h_c, y_c)`` per chunk; ``h_c`` is a view when every row counts."""
    rows = RowSource(hidden)
    dense = cfg.n_valid == rows.lead_shape.numel() and rows.flat is not None
    for start in range(0, cfg.n_valid, cfg.rows):
        stop = min(cfg.n_valid, start + cfg.rows)
        idx = valid_rows[start:stop]
        h = rows.flat[start:stop] if dense else rows.take(idx)
        yield start, stop, idx, h, y_valid[start:stop]


def _backprop_chunk(cfg: ChunkedConfig, dz, h, idx, y, coef, weight, grads: _Grads):
    if grads.dh is not None:
        part = torch.mm(dz, weight)
        launch_dhidden_rows(cfg.launch, grads.dh, idx, part=part, coef=coef, labels=y,
                            weight=weight)  # fmt: skip
        del part
    if grads.dw is not None:
        grads.dw.addmm_(dz.t(), h)
    if grads.db is not None:
        grads.db += dz.sum(0, dtype=torch.float32)


def _finish(cfg: ChunkedConfig, grads: _Grads, hidden, valid_rows, y_valid, coef):
    if grads.dw is not None or grads.db is not None:
        launch_target_dweight(cfg.launch, grads.dw, grads.db, y_valid, coef, hidden,
                              row_offsets(hidden, valid_rows))  # fmt: skip


def _pass(cfg: ChunkedConfig, hidden, weight, bias, valid_rows, y_valid, *, lse=None, scale=None,
          need=(False, False, False)):  # fmt: skip
    """One pass over the chunks.

    ``lse`` None: compute loss and LSE (and, when ``need`` asks, ``cfg.scale * gradients``:
    the eager schedule). ``lse`` given: recompute the gradients from it with ``scale`` (a 0-d
    tensor or ``[N]`` per-row weights). Returns ``(loss [M], lse [M], grads)``.
    """
    m, dev = cfg.n_valid, hidden.device
    compute = lse is None
    grad = any(need)
    loss_v = torch.empty(m, dtype=torch.float32, device=dev) if compute else None
    lse_v = torch.empty(m, dtype=torch.float32, device=dev) if compute else lse
    coef_v = torch.empty(m, dtype=torch.float32, device=dev) if grad else None
    grads = _new_grads(hidden, weight, bias, need) if grad else None
    for start, stop, idx, h, y in _chunks(cfg, hidden, valid_rows, y_valid):
        z = _logits(h, weight, bias)
        if compute:
            s = cfg.scale
        else:
            s = scale.index_select(0, idx) if scale.dim() == 1 else scale
        launch_logits_grad(
            cfg.launch, z, y, lse_v[start:stop],
            loss_v[start:stop] if compute else None,
            coef_v[start:stop] if grad else None,
            s, cfg.spec, compute_lse=compute, write_grad=grad,
        )  # fmt: skip
        if grad:
            _backprop_chunk(cfg, z, h, idx, y, coef_v[start:stop], weight, grads)
        del z, h
    if grad:
        _finish(cfg, grads, hidden, valid_rows, y_valid, coef_v)
    return loss_v, lse_v, grads


class AscendChunkedLinearCrossEntropy(torch.autograd.Function):
    """``apply(hidden, weight, bias, labels, valid_rows, cfg)`` → ``[N]`` float32 losses
    (``"none"``) or the 0-d ``scale * sum``. See the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid_rows, cfg: ChunkedConfig):
        y_valid = labels.index_select(0, valid_rows)
        loss_v, lse_v, grads = _pass(cfg, hidden, weight, bias, valid_rows, y_valid,
                                     need=cfg.need if cfg.eager else (False, False, False))
        ctx.cfg = cfg
        ctx.grads = grads
        if any(cfg.need):
            ctx.save_for_backward(hidden, weight, bias, valid_rows, y_valid, lse_v)
        if cfg.reduction == "none":
            out = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device)
            return out.index_copy_(0, valid_rows, loss_v)
        return loss_v.sum() * cfg.scale

    @staticmethod
    @single_backward
    def backward(ctx, grad_out):
        cfg: ChunkedConfig = ctx.cfg
        hidden, weight, bias, valid_rows, y_valid, lse_v = ctx.saved_tensors
        if cfg.eager:
            grads = ctx.grads
            # Handed to autograd, which may adopt the buffers as .grad; a second backward
            # through a retained graph replays the eager pass (bitwise the same).
            ctx.grads = None
            if grads is None:
                _, _, grads = _pass(cfg, hidden, weight, bias, valid_rows, y_valid,
                                    need=cfg.need)  # fmt: skip
            g = grad_out.item()  # one sync per backward; keeps the scale out of 16-bit rounding
            if g != 1.0:
                for t in (grads.dh, grads.dw, grads.db):
                    if t is not None:
                        t.mul_(g)
        else:
            need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                    bias is not None and ctx.needs_input_grad[2])  # fmt: skip
            if cfg.reduction == "none":
                scale = grad_out.reshape(-1).to(torch.float32)
            else:
                scale = grad_out.to(torch.float32) * cfg.scale
            _, _, grads = _pass(cfg, hidden, weight, bias, valid_rows, y_valid, lse=lse_v,
                                scale=scale, need=need)  # fmt: skip
        dh = None if grads.dh is None else grads.dh.view(hidden.shape)
        db = None if grads.db is None else grads.db.to(bias.dtype)
        return dh, grads.dw, db, None, None, None

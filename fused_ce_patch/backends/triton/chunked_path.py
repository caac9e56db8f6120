"""Chunked path of backends ``"triton"`` and ``"ascend"`` (``logits_budget > 0``).

Counted rows are cut into chunks whose logits fit the budget; per chunk::

    z      = h_c @ W.T (+ b)                  torch matmul (cuBLAS), input dtype, [r, V]
    z      = logits_grad(z)                   one Triton kernel: LSE, loss, and scale * dL/dz
                                              written over z, except the target column,
                                              whose value goes to a float32 coef_r
    dW    += z.T @ h_c                        addmm into dW (input dtype): the matmul
                                              reads dW in float32 compute, one rounding/chunk
    db    += z.sum(0)                         float32
    z[r, y_r] = coef_r                        the target column joins z for dH only
    dH[rows] = z @ W                          matmul with a float32 output, rounded once
and once at the end ``dW[y] += sum coef_r h_r`` (target column, float32, one rounding).

The kernels are called through ``cfg.launchers`` (:class:`~.launch.Launchers`): the CUDA
kernels by default, the NPU's persistent-grid kernels for backend ``"ascend"``.

No float32 copy of a chunk is made and nothing waits on the device inside the loop.

Why a driver of its own rather than :func:`fused_ce_patch.backends.chunked.run_chunked`: the
shared driver accumulates dW either in a float32 ``[V, H]`` buffer (2.4 GB at Gemma-2's size,
against a 256 MiB target) or by bf16 chunk sums, which loses precision (dW error 4.1e-3 vs
3.1e-3 for PyTorch's bf16 path at 9 chunks, float64-simulated). Splitting off the target part
(kernels module docstring) brings dW to ~1.7e-3 with no extra memory; that needs steps between
the kernel and the matmuls that the shared interface does not have. dH keeps PyTorch's
rounding (the whole gradient through one bf16 matmul).

Schedules, as in the shared driver: *eager* (scalar reductions with gradients, bfloat16 and
float32: gradients are formed in forward, 3 matmuls) and *recompute* (``reduction="none"``, and
every float16 call: forward keeps one LSE per counted row, backward recomputes the logits and
forms the gradient at the real upstream scale, one per row if need be). float16 cannot hold a
gradient formed before its upstream scale is known (``fp16`` loss scaling exists for that
reason): see :func:`fused_ce_patch.backends.chunked.forward_grad_safe`.

Precision choices are passed to the matmuls (:func:`_mm_fp32`); no process-wide torch flag
is read or set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import single_backward
from ..base import LossSpec
from ..chunked import RowSource
from .launch import CUDA_LAUNCHERS, Launchers, row_offsets


@dataclass
class ChunkedConfig:
    """Non-tensor arguments of :class:`TritonChunkedLinearCrossEntropy`."""

    spec: LossSpec
    reduction: str  # "none" | "sum"
    scale: float | torch.Tensor
    n_valid: int
    rows: int  # counted rows per chunk
    eager: bool
    need: tuple[bool, bool, bool]
    launchers: Launchers = CUDA_LAUNCHERS


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as a float32 tensor, reduced in float32 for 16-bit operands.

    torch lets cuBLAS reduce the split-K partial sums of 16-bit matmuls in the input dtype
    (``allow_{fp16,bf16}_reduced_precision_reduction``, on by default); dH's matmul (``K = V``,
    few rows) is where cuBLAS splits K, which cost fp16 dH 1.35x PyTorch's error on an H200.
    Asking this one matmul for a float32 output (``out_dtype``, CUDA) keeps its reduction in
    float32 without touching those process-wide flags, which other threads and other code
    read. Elsewhere (CPU under the interpreter, older torch) the product is widened after a
    plain matmul: CPU kernels accumulate 16-bit products in float32 anyway.
    """
    if a.dtype in (torch.float16, torch.bfloat16) and a.device.type == "cuda":
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # torch without mm.dtype
            pass
    return torch.mm(a, b).float()


def plan_rows(n_valid: int, rows_max: int) -> int:
    """Rows per chunk: as few chunks as ``rows_max`` allows, all of (nearly) equal size, so the
    last chunk is not a sliver that runs the matmuls at a fraction of their speed."""
    rows_max = max(1, rows_max)
    chunks = max(1, -(-n_valid // rows_max))
    return max(1, -(-n_valid // chunks))


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
    if bias is None:
        return torch.mm(h, weight.t())
    return torch.addmm(bias, h, weight.t())


def _backprop_chunk(dz, h, idx, y, coef, weight, grads: _Grads, rows: slice | None):
    """Add one chunk's gradient into dH, dW, db. ``dz`` holds the dense part (0 in each row's
    target column); dW and db take it as is (their target part comes later, in float32),
    then the target column is written into ``dz`` so that one matmul forms dH (rounded
    once). ``rows`` is the chunk's slice of dH when its rows are contiguous."""
    if grads.dw is not None:
        grads.dw.addmm_(dz.t(), h)
    if grads.db is not None:
        grads.db += dz.sum(0, dtype=torch.float32)
    if grads.dh is not None:
        dz.scatter_(1, y.unsqueeze(1), coef.unsqueeze(1).to(dz.dtype))
        part = _mm_fp32(dz, weight)
        if rows is not None:
            grads.dh[rows].copy_(part)
        else:
            grads.dh.index_copy_(0, idx, part.to(grads.dh.dtype))


def _finish(cfg: ChunkedConfig, grads: _Grads, hidden, valid_rows, y_valid, coef):
    """Target part of dW/db for every counted row."""
    if grads.dw is not None or grads.db is not None:
        cfg.launchers.target_dweight(
            grads.dw, grads.db, y_valid, coef, hidden, row_offsets(hidden, valid_rows)
        )


def _chunks(cfg: ChunkedConfig, hidden, valid_rows, y_valid):
    """``(start, stop, idx, h_c, y_c, rows)`` per chunk; when every row counts, ``h_c`` is a
    view and ``rows`` the chunk's slice of the ``[N, H]`` rows (else None)."""
    rows = RowSource(hidden)
    dense = cfg.n_valid == valid_rows.shape[0] == rows.lead_shape.numel() and rows.flat is not None
    for start in range(0, cfg.n_valid, cfg.rows):
        stop = min(cfg.n_valid, start + cfg.rows)
        idx = valid_rows[start:stop]
        h = rows.flat[start:stop] if dense else rows.take(idx)
        yield start, stop, idx, h, y_valid[start:stop], slice(start, stop) if dense else None


def _eager_pass(cfg: ChunkedConfig, hidden, weight, bias, valid_rows, y_valid, need):
    """Loss, LSE and ``cfg.scale * gradients`` of every counted row in one pass over chunks."""
    m, dev = cfg.n_valid, hidden.device
    loss_v = torch.empty(m, dtype=torch.float32, device=dev)
    lse_v = torch.empty(m, dtype=torch.float32, device=dev)
    nll_v = torch.empty(m, dtype=torch.float32, device=dev)
    coef_v = torch.empty(m, dtype=torch.float32, device=dev)
    grads = _new_grads(hidden, weight, bias, need)
    for start, stop, idx, h, y, rows in _chunks(cfg, hidden, valid_rows, y_valid):
        z = _logits(h, weight, bias)
        cfg.launchers.logits_grad(
            z, y, lse_v[start:stop], nll_v[start:stop], loss_v[start:stop],
            coef_v[start:stop], cfg.scale, cfg.spec, compute_lse=True, write_grad=True,
        )
        _backprop_chunk(z, h, idx, y, coef_v[start:stop], weight, grads, rows)
        del z, h
    _finish(cfg, grads, hidden, valid_rows, y_valid, coef_v)
    return loss_v, lse_v, nll_v, grads


def _stats_pass(cfg: ChunkedConfig, hidden, weight, bias, valid_rows, y_valid):
    """Loss, LSE and ``LSE - z_y`` of every counted row (no gradient)."""
    m, dev = cfg.n_valid, hidden.device
    loss_v = torch.empty(m, dtype=torch.float32, device=dev)
    lse_v = torch.empty(m, dtype=torch.float32, device=dev)
    nll_v = torch.empty(m, dtype=torch.float32, device=dev)
    for start, stop, _, h, y, _ in _chunks(cfg, hidden, valid_rows, y_valid):
        z = _logits(h, weight, bias)
        cfg.launchers.logits_grad(
            z, y, lse_v[start:stop], nll_v[start:stop], loss_v[start:stop], None, 1.0,
            cfg.spec, compute_lse=True, write_grad=False,
        )
        del z, h
    return loss_v, lse_v, nll_v


def _recompute_pass(cfg: ChunkedConfig, hidden, weight, bias, valid_rows, y_valid, lse_v, nll_v,
                    scale, need):
    """Gradients from the saved LSE; ``scale`` is a 0-d tensor or ``[N]`` per-row weights."""
    grads = _new_grads(hidden, weight, bias, need)
    coef_v = torch.empty(cfg.n_valid, dtype=torch.float32, device=hidden.device)
    for start, stop, idx, h, y, rows in _chunks(cfg, hidden, valid_rows, y_valid):
        z = _logits(h, weight, bias)
        s = scale.index_select(0, idx) if scale.dim() == 1 else scale
        cfg.launchers.logits_grad(
            z, y, lse_v[start:stop], nll_v[start:stop], None, coef_v[start:stop], s,
            cfg.spec, compute_lse=False, write_grad=True,
        )
        _backprop_chunk(z, h, idx, y, coef_v[start:stop], weight, grads, rows)
        del z, h
    _finish(cfg, grads, hidden, valid_rows, y_valid, coef_v)
    return grads


def _forward_pass(cfg: ChunkedConfig, hidden, weight, bias, valid_rows, y_valid):
    if cfg.eager:
        return _eager_pass(cfg, hidden, weight, bias, valid_rows, y_valid, cfg.need)
    return (*_stats_pass(cfg, hidden, weight, bias, valid_rows, y_valid), None)


class TritonChunkedLinearCrossEntropy(torch.autograd.Function):
    """``apply(hidden, weight, bias, labels, valid_rows, cfg)`` → ``[N]`` float32 losses
    (``"none"``) or the 0-d ``scale * sum``. See the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid_rows, cfg: ChunkedConfig):
        y_valid = labels.index_select(0, valid_rows)
        loss_v, lse_v, nll_v, grads = _forward_pass(cfg, hidden, weight, bias, valid_rows, y_valid)
        ctx.cfg = cfg
        ctx.grads = grads
        if any(cfg.need):
            ctx.save_for_backward(hidden, weight, bias, valid_rows, y_valid, lse_v, nll_v)
        if cfg.reduction == "none":
            out = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device)
            return out.index_copy_(0, valid_rows, loss_v)
        return loss_v.sum() * cfg.scale

    @staticmethod
    @single_backward
    def backward(ctx, grad_out):
        cfg: ChunkedConfig = ctx.cfg
        hidden, weight, bias, valid_rows, y_valid, lse_v, nll_v = ctx.saved_tensors
        if cfg.eager:
            grads: _Grads | None = ctx.grads
            # Handed to autograd, which may adopt the buffers as .grad without a copy; a second
            # backward through a retained graph replays the same pass (bitwise the same).
            ctx.grads = None
            if grads is None:
                *_, grads = _eager_pass(cfg, hidden, weight, bias, valid_rows, y_valid, cfg.need)
            g = grad_out.item()  # one sync per backward; keeps the scale out of bf16 rounding
            if g != 1.0:
                for t in (grads.dh, grads.dw, grads.db):
                    if t is not None:
                        t.mul_(g)
            return _outputs(grads, hidden.shape, bias)

        need = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        if cfg.reduction == "none":
            scale = grad_out.reshape(-1).to(torch.float32)
        else:
            scale = grad_out.to(torch.float32) * cfg.scale
        grads = _recompute_pass(cfg, hidden, weight, bias, valid_rows, y_valid, lse_v, nll_v,
                                scale, need)
        return _outputs(grads, hidden.shape, bias)


def _outputs(grads: _Grads, hidden_shape, bias):
    dh = None if grads.dh is None else grads.dh.view(hidden_shape)
    db = None if grads.db is None else grads.db.to(bias.dtype)
    return dh, grads.dw, db, None, None, None

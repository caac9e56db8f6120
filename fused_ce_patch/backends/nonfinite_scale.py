"""``sum / num_items_in_batch`` when ``1 / num_items_in_batch`` is not finite (0 or NaN).

transformers divides the summed loss by ``num_items_in_batch`` whatever its value; a 0 or a NaN
there (a caller's bug) makes the loss inf or NaN, loudly, and its gradient is what autograd of
``F.cross_entropy(logits.float(), y, reduction="sum") / n`` gives. With an infinite upstream
scale ``s`` that gradient is not ``s * (softmax - onehot)``: the log-softmax backward forms
``-s + p_y * s`` at the target, NaN for ``s = ±inf``, where the fused kernels (which form
``s * (p_y - 1)``) would give ``∓inf``. So this path computes the forward sum with the chosen
backend at scale 1, multiplies by the scale, and in backward runs the stock chain itself
(logits of a chunk of counted rows, ``F.cross_entropy``'s own autograd at the upstream
``s``, then the lm_head matmuls), chunk by chunk so that the extra memory stays bounded by
:data:`CHUNK_BYTES` of float32 logits (plus a float32 ``[V, H]`` weight-gradient accumulator).

It only runs for the degenerate divisors; speed is not its concern, exactness is.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ..errors import raise_if_double_backward
from .base import Backend, Problem

#: Bytes of float32 logits one chunk of the backward may hold.
CHUNK_BYTES = 64 * 2**20


def run_nonfinite_scale(problem: Problem, impl: Backend) -> torch.Tensor:
    """``problem.scale * sum`` for a non-finite Python float ``problem.scale`` (``"sum"``).

    Returns:
        0-d float32 (float64 for float64 inputs); differentiable w.r.t. hidden, weight, bias.
    """
    return _NonFiniteScale.apply(problem.hidden, problem.weight, problem.bias, problem, impl)


class _NonFiniteScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, problem: Problem, impl: Backend):
        total = impl.run(replace(problem, scale=1.0))
        ctx.problem = replace(problem, hidden=None, weight=None, bias=None)
        ctx.save_for_backward(hidden, weight, bias)
        return total * problem.scale

    @staticmethod
    def backward(ctx, grad_out):
        raise_if_double_backward("fused_linear_cross_entropy")
        hidden, weight, bias = ctx.saved_tensors
        p: Problem = ctx.problem
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        s = grad_out.detach().to(acc) * p.scale  # the upstream of the sum, as autograd forms it
        return (*stock_chain_grads(hidden, weight, bias, p.labels, p.valid_rows, p.n_valid,
                                   p.spec, s, ctx.needs_input_grad[:3]), None, None)


def stock_chain_grads(hidden, weight, bias, labels, valid_rows, n_valid, spec, s, needs):
    """``(dh, dw, db)`` of ``s * sum(loss rows)`` by the stock chain, chunk by chunk.

    ``s`` is the upstream of the summed loss (a 0-d tensor, any value: inf and NaN give
    stock's NaN pattern, which ``s * (softmax - onehot)`` does not); ``needs`` says which of
    the three to form. Also used by the chunked backend for a non-finite upstream gradient.
    """
    need_h, need_w, need_b = needs
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    rows = hidden.reshape(-1, hidden.shape[-1])
    dh = torch.zeros_like(rows) if need_h else None
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    db = (torch.zeros(weight.shape[0], dtype=acc, device=weight.device)
          if need_b and bias is not None else None)
    step = max(1, CHUNK_BYTES // (4 * weight.shape[0]))
    with torch.no_grad():
        for start in range(0, n_valid, step):
            idx = valid_rows[start:start + step]
            h = rows.index_select(0, idx)
            dz = _logits_grad(h, weight, bias, labels.index_select(0, idx), spec, s, acc)
            if dh is not None:
                dh.index_copy_(0, idx, torch.mm(dz.to(weight.dtype), weight).to(dh.dtype))
            if dw is not None:
                dw.addmm_(dz.t(), h.to(acc))
            if db is not None:
                db += dz.sum(0)
    return (
        None if dh is None else dh.view(hidden.shape),
        None if dw is None else dw.to(weight.dtype),
        None if db is None else db.to(bias.dtype),
    )


def _logits_grad(h, weight, bias, y, spec, s, acc) -> torch.Tensor:
    """``[r, V]`` gradient of ``s * sum(loss rows)`` w.r.t. the logits, by autograd of the
    stock chain (``lm_head`` output upcast, softcap, ``F.cross_entropy``, z-loss)."""
    logits = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())
    z = logits.to(acc).requires_grad_()
    with torch.enable_grad():
        capped = z if spec.softcap is None else spec.softcap * torch.tanh(z / spec.softcap)
        loss = F.cross_entropy(capped, y, reduction="none",
                               label_smoothing=spec.label_smoothing)
        if spec.z_loss:
            loss = loss + spec.z_loss * torch.logsumexp(capped, dim=-1).square()
        (dz,) = torch.autograd.grad(loss.sum(), z, s)
    return dz

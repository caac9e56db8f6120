"""Per-token statistics of ``hidden @ weight.T (+ bias)`` in row chunks: log-probability of the
label, entropy, and whether the label is the argmax, without the ``[N, V]`` logits.

Used by :func:`fused_ce_patch.fused_linear_token_stats`, which validates the call and hands the
counted rows here. The algorithm runs in plain torch (matmuls plus element-wise ops per chunk),
so it works on every device torch runs on (CPU, CUDA, NPU); the matmuls go to the device's
BLAS.

Optionally also ``mean_v z_v`` and ``log sum_v p_v^2`` (TRL's ``mean_logits`` and
``log_sum_sq_probs``, without gradient). Per chunk of ``R`` rows (``R`` chosen so that about four float32 ``[R, V]`` temporaries fit in
``logits_budget``) the forward computes ``z = T(h W^T + b)``, with
``T(x) = c * tanh(s * x / c) / t`` (logit scale ``s``, softcap ``c``, temperature ``t``), then
``log p_y = z_y - LSE(z)``, ``H = LSE(z) - sum_v p_v z_v`` and ``argmax z == y``, keeping only
``[R]``-sized results. The backward recomputes each chunk's logits and forms

    dL/dz_v = g_lp * (1[v = y] - p_v) - g_H * p_v * (log p_v + H)

then chains through ``T`` and projects with ``dh = dz W``, ``dW += dz^T h``, ``db += sum dz``,
accumulating in float32 (float64 for float64 inputs). Peak extra memory is the chunk's
temporaries plus one float32 copy of ``dW``, never ``N * V``.

Source of the entropy gradient: ``d/dz_v (-sum_u p_u log p_u) = -p_v (log p_v + H)``; the same
form is used by TRL's ``trl/kernels/chunked_logprob.py`` (read for the field names, not copied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Default bytes of transient logits per chunk when the caller gives no budget.
DEFAULT_BUDGET = 256 * 2**20
#: float32 ``[R, V]`` temporaries alive at once in the backward (z, p, log p / dz, one spare).
_TEMPORARIES = 4


@dataclass(frozen=True)
class Transform:
    """``z = softcap * tanh(logit_scale * x / softcap) / temperature`` (softcap optional)."""

    logit_scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    def apply(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(z, tanh)``; ``tanh`` is kept for the softcap derivative (None without softcap)."""
        if self.logit_scale != 1.0:
            x = x * self.logit_scale
        t = None
        if self.softcap is not None:
            t = torch.tanh(x / self.softcap)
            x = self.softcap * t
        if self.temperature != 1.0:
            x = x / self.temperature
        return x, t

    def chain(self, dz: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        """``dL/dx`` from ``dL/dz`` (in place on ``dz``)."""
        if self.temperature != 1.0:
            dz.div_(self.temperature)
        if t is not None:
            dz.mul_(1.0 - t * t)
        if self.logit_scale != 1.0:
            dz.mul_(self.logit_scale)
        return dz


def chunk_rows(n_rows: int, vocab: int, budget: int | None) -> int:
    """Rows per chunk so that the float32 temporaries fit in ``budget`` bytes (at least 1)."""
    budget = DEFAULT_BUDGET if budget is None or budget <= 0 else budget
    return max(1, min(n_rows, budget // (_TEMPORARIES * 4 * max(vocab, 1))))


def _logits(h, weight, bias, acc, transform):
    z = (h @ weight.t()).to(acc)
    if bias is not None:
        z = z + bias.to(acc)
    return transform.apply(z)


class TokenStatsFunction(torch.autograd.Function):
    """``(log_probs, entropy, is_top1, mean_logits, log_sum_sq_probs)`` of ``M`` rows that all
    have a valid label; each optional output is None unless its name is in ``extras``.

    ``is_top1``, ``mean_logits`` (``mean_v z_v``) and ``log_sum_sq_probs``
    (``log sum_v p_v^2``) carry no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, transform, extras, rows):
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        m = hidden.shape[0]

        def new(name, dtype=acc):
            return torch.empty(m, dtype=dtype, device=hidden.device) if name in extras else None

        log_probs = new("log_probs")
        entropy, is_top1 = new("entropy"), new("is_top1", torch.bool)
        mean_logits, log_sum_sq = new("mean_logits"), new("log_sum_sq_probs")
        lse_all = torch.empty(m, dtype=acc, device=hidden.device)
        for r0 in range(0, m, rows):
            r1 = min(r0 + rows, m)
            y = labels[r0:r1]
            z, _ = _logits(hidden[r0:r1], weight, bias, acc, transform)
            lse = torch.logsumexp(z, dim=-1)
            lse_all[r0:r1] = lse
            z_y = z.gather(1, y.unsqueeze(1)).squeeze(1)
            log_probs[r0:r1] = z_y - lse
            if is_top1 is not None:
                # argmax takes the first maximum: a tie with an earlier token is not a hit
                is_top1[r0:r1] = z.argmax(dim=-1) == y
            if mean_logits is not None:
                mean_logits[r0:r1] = z.mean(dim=-1)
            if entropy is not None:
                p = torch.exp(z - lse.unsqueeze(1))
                entropy[r0:r1] = lse - (p * z).sum(dim=-1)
                del p
            if log_sum_sq is not None:
                log_sum_sq[r0:r1] = torch.logsumexp(2.0 * (z - lse.unsqueeze(1)), dim=-1)
            del z
        ctx.transform = transform
        ctx.rows = rows
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, lse_all, entropy)
        ctx.mark_non_differentiable(
            *(x for x in (is_top1, mean_logits, log_sum_sq) if x is not None)
        )
        return log_probs, entropy, is_top1, mean_logits, log_sum_sq

    @staticmethod
    def backward(ctx, g_lp, g_ent, *_non_differentiable):
        hidden, weight, bias, labels, lse_all, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None
        acc = lse_all.dtype
        transform = ctx.transform
        m = hidden.shape[0]
        dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        for r0 in range(0, m, ctx.rows):
            r1 = min(r0 + ctx.rows, m)
            h = hidden[r0:r1]
            z, t = _logits(h, weight, bias, acc, transform)
            log_p = z.sub_(lse_all[r0:r1].unsqueeze(1))  # z is not needed any more
            p = torch.exp(log_p)
            dz = torch.zeros_like(p)
            if g_ent is not None:
                dz.addcmul_(p, log_p + entropy[r0:r1].unsqueeze(1), value=-1.0)
                dz.mul_(g_ent[r0:r1].to(acc).unsqueeze(1))
            del log_p
            if g_lp is not None:
                g = g_lp[r0:r1].to(acc)
                dz.addcmul_(p, g.unsqueeze(1), value=-1.0)
                dz.scatter_add_(1, labels[r0:r1].unsqueeze(1), g.unsqueeze(1))
            del p
            dz = transform.chain(dz, t)
            if need_b:
                db.add_(dz.sum(dim=0))
            # the projections run in the inputs' dtype (like lm_head's own backward); the
            # float32 dW accumulator keeps chunk sums from rounding to half precision
            dz = dz.to(hidden.dtype)
            if need_h:
                dh[r0:r1] = dz @ weight
            if need_w:
                if dw.dtype == dz.dtype:
                    dw.addmm_(dz.t(), h)
                else:
                    dw.add_(dz.t() @ h)
        return (
            dh,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            None, None, None, None,
        )


def token_stats_chunked(hidden, weight, bias, labels, transform, extras, logits_budget):
    """Run :class:`TokenStatsFunction` on ``[M, H]`` rows with ``[M]`` valid labels."""
    rows = chunk_rows(hidden.shape[0], weight.shape[0], logits_budget)
    return TokenStatsFunction.apply(hidden, weight, bias, labels, transform,
                                    frozenset(extras) | {"log_probs"}, rows)


def token_stats_reference(hidden, weight, bias, labels, transform, extras):
    """The oracle: whole ``[M, V]`` logits in float32 (float64 for float64), autograd backward."""
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    z = hidden.to(acc) @ weight.to(acc).t()
    if bias is not None:
        z = z + bias.to(acc)
    z, _ = transform.apply(z)
    log_p = torch.log_softmax(z, dim=-1)
    log_probs = log_p.gather(1, labels.unsqueeze(1)).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1) if "entropy" in extras else None
    is_top1 = (z.argmax(dim=-1) == labels) if "is_top1" in extras else None
    with torch.no_grad():
        mean_logits = z.mean(dim=-1) if "mean_logits" in extras else None
        log_sum_sq = torch.logsumexp(2.0 * log_p, dim=-1) if "log_sum_sq_probs" in extras else None
    return log_probs, entropy, is_top1, mean_logits, log_sum_sq

"""Per-token statistics of ``hidden @ weight.T (+ bias)`` in tiles: log-probability of the
label, entropy, and whether the label is the argmax, without the ``[N, V]`` logits.

Used by :func:`fused_ce_patch.fused_linear_token_stats`, which validates the call and hands the
counted rows here. The algorithm runs in plain torch (matmuls plus element-wise ops per tile),
so it works on every device torch runs on (CPU, CUDA, NPU); the matmuls go to the device's
BLAS.

Optionally also ``mean_v z_v`` and ``log sum_v p_v^2`` (TRL's ``mean_logits`` and
``log_sum_sq_probs``, without gradient). The logits are visited in tiles of ``R`` rows by ``Vb``
vocabulary columns, sized so that all the tile's temporaries at once (at most four float32
``[R, Vb]`` eager, float64 for float64 inputs; about half that when compiled) fit in
``logits_budget``: the element-wise steps after the first write in place. With
``T(x) = c * tanh(s * x / c) / t`` (logit scale ``s``, softcap ``c``, temperature ``t``), the
forward computes each tile's ``z = T(h W_b^T + b_b)`` and folds it into per-row running
statistics (online log-sum-exp: running max ``m``, ``sum exp(z - m)``, ``sum exp(z - m) z``,
the label's logit, the first argmax), giving ``log p_y = z_y - LSE``,
``H = LSE - sum_v p_v z_v`` and ``argmax z == y`` with only ``[M]``-sized state. The backward walks vocabulary blocks in the outer loop, recomputes each
tile's logits, and forms

    dL/dz_v = g_lp * (1[v = y] - p_v) - g_H * p_v * (log p_v + H)

then chains through ``T`` and projects with ``dh += dz W_b`` (float32 ``[M, H]``
accumulator) and ``dW_b = dz^T h`` (complete once its rows are done, so no float32 copy of
the whole ``dW`` is held), ``db_b = sum dz``; projections run in the inputs' dtype with float32
(float64 for float64) accumulation. Peak extra memory: the tile temporaries, one ``[M, H]``
float32 accumulator and one ``[Vb, H]`` block; never ``N * V``.

Source of the entropy gradient: ``d/dz_v (-sum_u p_u log p_u) = -p_v (log p_v + H)``; the same
form is used by TRL's ``trl/kernels/chunked_logprob.py`` (read for the field names, not copied).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Default bytes of transient logits per tile when the caller gives no budget.
DEFAULT_BUDGET = 256 * 2**20
#: Accumulator-sized values per tile cell that one tile holds at once. Eager: the matmul
#: output ``x`` plus at most three ``[R, Vb]`` temporaries (``z`` / ``log p`` / ``dz`` in one
#: buffer, ``p`` or ``exp(z - m)``, the softcap's ``tanh``), and ``dz`` cast to a 16-bit
#: input dtype: at most four float32 values (float64: four float64) per cell, measured by
#: tests/test_tile_policy.py. Compiled (the tile math fused into one kernel): the matmul
#: output and ``dz``, plus headroom.
_CELLS_EAGER = 4
_CELLS_COMPILED = 2
#: float32 accumulators: 16 bytes per cell eager, 8 compiled.
_CELL_BYTES_EAGER = 4 * _CELLS_EAGER
_CELL_BYTES_COMPILED = 4 * _CELLS_COMPILED
#: Most rows in one tile: enough for full-speed matmuls, few enough to leave room for wide
#: vocabulary blocks.
ROWS_MAX = 8192


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


def tile_shape(n_rows: int, vocab: int, budget: int | None,
               cell_bytes: int = _CELL_BYTES_EAGER) -> tuple[int, int]:
    """``(R, Vb)``: rows and vocabulary columns of one tile, so that the temporaries of a tile
    (``cell_bytes`` per cell) fit in ``budget`` bytes (each at least 1)."""
    budget = DEFAULT_BUDGET if budget is None or budget <= 0 else budget
    cells = max(1, budget // cell_bytes)
    block = min(vocab, max(1, cells // max(1, min(n_rows, ROWS_MAX))))
    rows = min(n_rows, ROWS_MAX, max(1, cells // block))
    return max(rows, 1), block


def _transform(x, b, acc, scale, softcap, temperature):
    """``(z, tanh or None)`` of one tile of raw logits ``x``; ``z`` is always a new tensor (never
    ``x`` itself), so callers may overwrite it; every later step works in place on it."""
    z = x.to(acc, copy=True)
    if b is not None:
        z.add_(b.to(acc))
    if scale != 1.0:
        z.mul_(scale)
    t = None
    if softcap is not None:
        t = torch.tanh(z.div_(softcap))
        z = torch.mul(t, softcap, out=z)  # z's storage: no third tile
    if temperature != 1.0:
        z.div_(temperature)
    return z, t


def forward_tile(x, b, y_local, run_max, acc: torch.dtype, scale: float, softcap,
                 temperature: float, entropy: bool, sq: bool, mean: bool):
    """Row statistics of one ``[R, Vb]`` tile of raw logits ``x`` (``h W_b^T``, input dtype).

    Returns ``(top, at, new_max, alpha, sum_e, sum_ez, sum_ee, sum_z, picked)``, all ``[R]``:
    the tile's first maximum and its column, the running max after it, the rescale factor of
    earlier sums, ``sum exp(z - new_max)`` (times ``z``, squared), ``sum z`` and the logit at
    column ``y_local`` (clamped; the caller keeps it only where the label is in the tile).
    Unrequested sums are None. Tile-sized temporaries besides ``x``: ``z``, ``exp(z - m)``
    and one product of them at a time (the softcap's ``tanh`` is freed before).
    """
    z, t = _transform(x, b, acc, scale, softcap, temperature)
    del t
    top, at = z.max(dim=-1)
    new_max = torch.maximum(run_max, top)
    alpha = torch.exp(run_max - new_max)
    sum_z = z.sum(dim=-1) if mean else None
    picked = z.gather(1, y_local.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    e = torch.sub(z, new_max.unsqueeze(1)).exp_()
    sum_e = e.sum(dim=-1)
    # element-wise products, not a matmul: TF32 (if allowed) must not round these sums
    sum_ez = (e * z).sum(dim=-1) if entropy else None
    sum_ee = (e * e).sum(dim=-1) if sq else None
    return top, at, new_max, alpha, sum_e, sum_ez, sum_ee, sum_z, picked


def backward_tile(x, b, y_local, lse, ent, g_lp, g_ent, acc: torch.dtype, scale: float,
                  softcap, temperature: float, out_dtype: torch.dtype, need_b: bool):
    """``(dL/dx in out_dtype, its column sums in acc or None)`` for one tile of raw logits.

    ``dL/dz_v = g_lp (1[v = y] - p_v) - g_ent p_v (log p_v + H)``, chained through the
    temperature, the softcap and the logit scale. ``g_lp`` / ``g_ent`` may be None.
    Tile-sized temporaries besides ``x``: ``log p`` (which becomes ``dz``), ``p`` (and the
    softcap's ``tanh``), plus ``dz`` in ``out_dtype`` when that differs from ``acc``.
    """
    z, t = _transform(x, b, acc, scale, softcap, temperature)
    log_p = z.sub_(lse.unsqueeze(1))
    p = torch.exp(log_p)
    if g_ent is not None:
        # -g_ent p (log p + H), written over log p
        dz = log_p.add_(ent.unsqueeze(1)).mul_(p).mul_(-g_ent.unsqueeze(1))
        if g_lp is not None:
            dz.sub_(p.mul_(g_lp.unsqueeze(1)))
    elif g_lp is not None:
        dz = p.mul_(-g_lp.unsqueeze(1))
        del log_p
    else:
        dz = log_p.zero_()
    del p
    if g_lp is not None:
        # + g_lp at the label's column, where the label lies in this tile
        inside = (y_local >= 0) & (y_local < dz.shape[1])
        dz.scatter_add_(1, y_local.clamp(0, dz.shape[1] - 1).unsqueeze(1),
                        (g_lp * inside).unsqueeze(1))
    if temperature != 1.0:
        dz.div_(temperature)
    if t is not None:
        dz.mul_(t.mul_(t).neg_().add_(1.0))
    if scale != 1.0:
        dz.mul_(scale)
    db = dz.sum(dim=0) if need_b else None
    return dz.to(out_dtype), db


#: ``$FUSED_CE_TOKEN_STATS_COMPILE=0`` keeps the tile functions eager on CUDA; ``force``
#: compiles them on every device (to test the compiled path on CPU).
COMPILE_ENV = "FUSED_CE_TOKEN_STATS_COMPILE"
_compiled: dict = {}
_compile_failed: set = set()


def _compile_wanted(fn, device: torch.device) -> bool:
    import os

    mode = os.environ.get(COMPILE_ENV, "1").strip().lower()
    if fn in _compile_failed or mode in ("0", "false", "no", "off"):
        return False
    return device.type == "cuda" or mode == "force"  # "force": any device (tests)


def _tile_fn(fn, device: torch.device):
    """``fn``, fused by ``torch.compile`` on CUDA (one kernel per tile instead of a dozen
    element-wise passes over ``[R, Vb]``); eager elsewhere or if compiling fails."""
    if not _compile_wanted(fn, device):
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=None)
    compiled = _compiled[fn]

    def call(*args):
        if fn in _compile_failed:
            return fn(*args)
        try:
            return compiled(*args)
        except Exception as exc:  # noqa: BLE001 - the eager function computes the same thing
            _compile_failed.add(fn)
            import logging

            logging.getLogger(__name__).warning(
                "fused_ce_patch: torch.compile of %s failed (%s: %s); running it eagerly",
                fn.__name__, type(exc).__name__, str(exc)[:200])
            return fn(*args)

    return call


def _addmm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into a float32/64 ``acc`` from inputs of any float dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.device.type == "cuda":
        try:  # torch >= 2.8 on CUDA: half inputs, float32 product, no rounding in between
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (TypeError, RuntimeError):
            acc.add_(a @ b)
    else:
        acc.add_(a @ b)


class TokenStatsFunction(torch.autograd.Function):
    """``(log_probs, entropy, is_top1, mean_logits, log_sum_sq_probs)`` of ``M`` rows that all
    have a valid label; each optional output is None unless its name is in ``extras``.

    ``is_top1``, ``mean_logits`` (``mean_v z_v``) and ``log_sum_sq_probs``
    (``log sum_v p_v^2``) carry no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, transform, extras, tile):
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        m, vocab = hidden.shape[0], weight.shape[0]
        rows, block = tile
        dev = hidden.device
        fold = _tile_fn(forward_tile, dev)
        consts = (acc, transform.logit_scale, transform.softcap, transform.temperature)
        flags = ("entropy" in extras, "log_sum_sq_probs" in extras, "mean_logits" in extras)

        def new(fill, dtype=acc):
            return torch.full((m,), fill, dtype=dtype, device=dev)

        run_max, sum_exp, target = new(-math.inf), new(0.0), new(0.0)
        z_exp = new(0.0) if flags[0] else None
        sq_exp = new(0.0) if flags[1] else None
        z_sum = new(0.0) if flags[2] else None
        top1 = "is_top1" in extras
        if top1:
            best, best_at = new(-math.inf), new(0, torch.int64)
        for r0 in range(0, m, rows):
            r1 = min(r0 + rows, m)
            h, y = hidden[r0:r1], labels[r0:r1]
            for v0 in range(0, vocab, block):
                v1 = min(v0 + block, vocab)
                x = h @ weight[v0:v1].t()
                y_local = y - v0
                top, at, new_max, alpha, s_e, s_ez, s_ee, s_z, picked = fold(
                    x, None if bias is None else bias[v0:v1], y_local, run_max[r0:r1],
                    *consts, *flags)
                del x
                if top1:
                    # strictly greater: an earlier block keeps a tie (torch.argmax semantics)
                    better = top > best[r0:r1]
                    best[r0:r1] = torch.where(better, top, best[r0:r1])
                    best_at[r0:r1] = torch.where(better, at + v0, best_at[r0:r1])
                sum_exp[r0:r1] = sum_exp[r0:r1] * alpha + s_e
                if z_exp is not None:
                    z_exp[r0:r1] = z_exp[r0:r1] * alpha + s_ez
                if sq_exp is not None:
                    sq_exp[r0:r1] = sq_exp[r0:r1] * alpha * alpha + s_ee
                if z_sum is not None:
                    z_sum[r0:r1] += s_z
                run_max[r0:r1] = new_max
                inside = (y_local >= 0) & (y_local < v1 - v0)
                target[r0:r1] = torch.where(inside, picked, target[r0:r1])
        lse = run_max + torch.log(sum_exp)
        log_probs = target - lse
        entropy = None if z_exp is None else lse - z_exp / sum_exp
        is_top1 = best_at == labels if top1 else None
        mean_logits = None if z_sum is None else z_sum / vocab
        log_sum_sq = None if sq_exp is None else torch.log(sq_exp) - 2.0 * torch.log(sum_exp)
        ctx.transform = transform
        ctx.tile = tile
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.mark_non_differentiable(
            *(x for x in (is_top1, mean_logits, log_sum_sq) if x is not None)
        )
        return log_probs, entropy, is_top1, mean_logits, log_sum_sq

    @staticmethod
    def backward(ctx, g_lp, g_ent, *_non_differentiable):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None
        acc = lse.dtype
        transform = ctx.transform
        rows, block = ctx.tile
        m, vocab = hidden.shape[0], weight.shape[0]
        g_lp = None if g_lp is None else g_lp.to(acc)
        g_ent = None if g_ent is None else g_ent.to(acc)
        grad_tile = _tile_fn(backward_tile, hidden.device)
        consts = (acc, transform.logit_scale, transform.softcap, transform.temperature,
                  hidden.dtype, bool(need_b))
        # dH sums over vocabulary blocks (float32 [M, H]); each dW block is complete after its
        # pass over the rows, so no float32 copy of the whole weight is ever held.
        dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        dw = torch.empty_like(weight) if need_w else None
        db = torch.empty_like(bias) if need_b else None
        for v0 in range(0, vocab, block):
            v1 = min(v0 + block, vocab)
            w_blk = weight[v0:v1]
            b_blk = None if bias is None else bias[v0:v1]
            dw_blk = torch.zeros(w_blk.shape, dtype=acc, device=weight.device) if need_w else None
            db_blk = torch.zeros(v1 - v0, dtype=acc, device=weight.device) if need_b else None
            for r0 in range(0, m, rows):
                r1 = min(r0 + rows, m)
                h = hidden[r0:r1]
                dz, db_part = grad_tile(
                    h @ w_blk.t(), b_blk, labels[r0:r1] - v0, lse[r0:r1],
                    None if entropy is None else entropy[r0:r1],
                    None if g_lp is None else g_lp[r0:r1],
                    None if g_ent is None else g_ent[r0:r1], *consts)
                if need_b:
                    db_blk.add_(db_part)
                # projections in the inputs' dtype, as lm_head's own backward runs them
                if need_h:
                    _addmm_acc(dh[r0:r1], dz, w_blk)
                if need_w:
                    _addmm_acc(dw_blk, dz.t(), h)
                del dz
            if need_w:
                dw[v0:v1] = dw_blk.to(weight.dtype)
            if need_b:
                db[v0:v1] = db_blk.to(bias.dtype)
        return (
            None if dh is None else dh.to(hidden.dtype),
            dw, db, None, None, None, None,
        )


def token_stats_chunked(hidden, weight, bias, labels, transform, extras, logits_budget):
    """Run :class:`TokenStatsFunction` on ``[M, H]`` rows with ``[M]`` valid labels."""
    compiled = _compile_wanted(forward_tile, hidden.device) and _compile_wanted(
        backward_tile, hidden.device)
    acc_bytes = 8 if hidden.dtype == torch.float64 else 4
    tile = tile_shape(hidden.shape[0], weight.shape[0], logits_budget,
                      acc_bytes * (_CELLS_COMPILED if compiled else _CELLS_EAGER))
    return TokenStatsFunction.apply(hidden, weight, bias, labels, transform,
                                    frozenset(extras), tile)


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

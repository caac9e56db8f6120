"""Per-token statistics on backend ``"triton"``: cuBLAS logits chunks and one Triton row kernel.

The chunked path of the loss (:mod:`.chunked_path`), with the row kernel of
:mod:`.stats_kernels` in place of the loss kernel. Per chunk of ``r`` counted rows::

    forward:   x = h_c @ W.T (+ b)        [r, V], input dtype
               stats(x)                   max, log sum exp, -log p_y, and the requested
                                          entropy, is_top1, mean logit, log sum p^2
                                          (float32 [r])
    backward:  x = h_c @ W.T (+ b)        recomputed
               grad(x) -> dx in place     dense part; target column to coef_r (float32)
               dW += dx.T @ h_c ; db += dx.sum(0) ; dH[rows] = (dx + coef at y) @ W

and at the end ``dW[y] += sum coef_r h_r``, as the loss's chunked path does (its helpers are
reused, so dW and dH round exactly as the loss's do).

The upstream gradients of ``log_probs`` are per position in general (GRPO advantages, DPO
weights), so the gradient needs the backward's values: 4 matmuls per chunk. When the caller
passes a :class:`~fused_ce_patch.token_stats.ForwardGradHint` that is on, the forward also
forms the gradient for an upstream gradient of 1 on every ``log_prob`` and none on the entropy
(3 matmuls, as the loss), betting that the backward receives one value ``c`` for every counted
position — what a mean or sum of log-probabilities gives (SFT). The backward checks the bet
with one host sync: if it holds, the forward's gradients times ``c`` are exact; if not, they
are dropped, the gradient is recomputed as above, and the hint turns itself off so that later
calls of the same caller go straight to the recompute schedule. float16 never bets
(:func:`~fused_ce_patch.backends.chunked.forward_grad_safe`).

With 16-bit inputs the recompute runs on column tiles where they pay (:func:`plan_columns`,
:func:`_grad_pass_columns`): forward's statistics hold for any slice of a row's columns, so
the backward can take all of a group's rows (up to :data:`COL_GROUP_ROWS`) by a slice of the
vocabulary at a time::

    per group g, per tile c:   x = h_g @ W_c.T (+ b_c) ; grad(x) -> dx in place
                               dW_c (=|+=) dx.T @ h_g ; db_c += dx.sum(0) ; acc += dx @ W_c
    per group:                 acc += coef_r W[y_r] ; dH[g] = acc        (float32 acc, [g, H])

The row chunks read and write all of dW once per chunk (~500 rows at a 256K vocabulary within
256 MiB); the tiles do it once per group. On an H200 that took 6-11 % off the head's fwd+bwd
at Gemma-2, Qwen2.5 and Gemma-3 shapes (BENCHMARKS.md, 2026-12-03 midday); dH, its target
column added in float32, lost a third of its error (1.7e-3 against float32 logits, from
2.4-3.2e-3).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ...errors import single_backward
from ..chunked import forward_grad_safe
from .chunked_path import _backprop_chunk, _Grads, _logits, _new_grads, plan_rows
from .chunked_path import _finish as finish_chunks
from .launch import CUDA_LAUNCHERS, stats_kernel_config
from .stats_kernels import token_stats_row_kernel
from .zero_logits_inplace import _addmm_fp32_

logger = logging.getLogger(__name__)


def rows_per_chunk(m: int, vocab: int, dtype: torch.dtype, budget: int) -> int:
    """Counted rows a chunk of ``budget`` bytes of logits holds (0 when fewer than 1)."""
    return budget // (vocab * torch.empty((), dtype=dtype).element_size())


def _launch(z, labels, out, coef, *, stats, grad, extras, transform, g_lp=None, g_lp_value=0.0,
            g_ent=None, col0=None):
    """The row kernel on chunk ``z``; ``col0``: ``z`` holds the columns ``[col0, col0 +
    z.shape[1])`` of the vocabulary (gradient only), else all of them."""
    r, vocab = z.shape
    if r == 0:
        return
    cfg = stats_kernel_config(vocab, z.device, transform.softcap is not None)
    mx, log_s, nll, ent, top1, mean, sq = out
    dummy = mx
    token_stats_row_kernel[(r,)](
        z, z.stride(0), labels, mx, log_s, nll,
        ent if ent is not None else dummy,
        top1 if top1 is not None else dummy,
        mean if mean is not None else dummy,
        sq if sq is not None else dummy,
        coef if coef is not None else dummy,
        g_lp if g_lp is not None else dummy, float(g_lp_value),
        g_ent if g_ent is not None else dummy,
        vocab, float(transform.logit_scale), float(transform.softcap or 1.0),
        float(transform.temperature), 0 if col0 is None else int(col0),
        HAS_SOFTCAP=transform.softcap is not None,
        STATS=stats,
        ENTROPY=stats and "entropy" in extras,
        TOP1=stats and "is_top1" in extras,
        MEAN=stats and "mean_logits" in extras,
        SQ=stats and "log_sum_sq_probs" in extras,
        GRAD=grad,
        G_LP=0 if not grad else (2 if g_lp is not None else 1),
        G_ENT=grad and g_ent is not None,
        BLOCK_V=cfg.block_v, FIX_RNE=z.device.type == "cpu", NUM_STAGES=cfg.num_stages,
        SUB_ROWS=cfg.sub_rows, FAST_MATH=cfg.fast_math,
        # stats and gradient in one launch: the entropy from the gradient pass's p
        ENTROPY_IN_GRAD=stats and grad and "entropy" in extras and g_ent is None,
        COL_TILE=col0 is not None,
        num_warps=cfg.num_warps,
    )  # fmt: skip


def _finish(grads: _Grads, hidden, labels, coef):
    """Target part of dW/db (float32, one rounding per row of dW), as the loss does."""
    rows = torch.arange(labels.shape[0], device=labels.device)
    finish_chunks(CUDA_LAUNCHERS, grads, hidden, rows, labels, coef)


def _grad_pass(hidden, weight, bias, labels, out, rows, need, transform, extras, *,
               g_lp=None, g_lp_value=0.0, g_ent=None):
    """dH, dW, db for the upstream gradients given (recomputing each chunk's logits)."""
    m = hidden.shape[0]
    grads = _new_grads(hidden, weight, bias, need)
    coef = torch.empty(m, dtype=torch.float32, device=hidden.device)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        h, y = hidden[r0:r1], labels[r0:r1]
        z = _logits(h, weight, bias)
        part = tuple(None if t is None else t[r0:r1] for t in out)
        _launch(z, y, part, coef[r0:r1], stats=False, grad=True, extras=extras,
                transform=transform,
                g_lp=None if g_lp is None else g_lp[r0:r1], g_lp_value=g_lp_value,
                g_ent=None if g_ent is None else g_ent[r0:r1])
        _backprop_chunk(z, h, None, y, coef[r0:r1], weight, grads, slice(r0, r1))
        del z
    _finish(grads, hidden, labels, coef)
    return grads


@dataclass(frozen=True)
class ColumnPlan:
    """Tiles of the column-tiled backward: ``rows`` counted rows a group, ``cols`` vocabulary
    columns a tile (the last group and tile may be smaller)."""

    rows: int
    cols: int


#: Most rows of a group of the column-tiled backward (TRL's head takes 4096): dW is read and
#: written once per group, the float32 dH accumulator holds a group.
COL_GROUP_ROWS = 8192
#: The column-tiled backward is taken when a group holds at least this many times the rows of
#: a row chunk at the same budget (fewer updates of the whole dW), and a tile at least
#: :data:`COL_MIN_COLS` columns (matmuls of full speed).
COL_MIN_ROW_GAIN = 4
COL_MIN_COLS = 1024


def plan_columns(m: int, hsize: int, vocab: int, itemsize: int, budget: int) -> ColumnPlan | None:
    """Groups and tiles of the column-tiled backward within ``budget`` bytes, or None where the
    row chunks do as well (see :data:`COL_MIN_ROW_GAIN`) or the inputs are not 16-bit.

    A tile's logits (``rows x cols`` in the input dtype, ``itemsize`` bytes) and the group's
    float32 dH accumulator (``rows x hsize``) together stay within ``budget``; the accumulator
    takes at most half of it. Groups and tiles are of (nearly) equal size, tiles a multiple of
    8 columns (16-byte rows) wherever that stays within the budget.

    Only 16-bit inputs (``itemsize == 2``): the tiles' matmuls have other shapes than the
    forward's chunks, so their float32 sums may differ from the logits that forward's
    log-sum-exp came from in the last bits. Rounded to 16 bits that is at most one rounding
    step on a few logits, the error every 16-bit logit already carries; in float32 the row
    chunks, whose matmuls repeat forward's bit for bit, are 5-70x more accurate (gradients
    against float64 under the interpreter, largest at logits ~100)."""
    if m < 1 or vocab < 1 or hsize < 1 or itemsize != 2:
        return None
    acc_row = 4 * hsize
    rows = min(m, COL_GROUP_ROWS, (budget // 2) // acc_row)
    chunk_rows = budget // (vocab * itemsize)
    if rows < 1 or rows < COL_MIN_ROW_GAIN * max(1, chunk_rows):
        return None
    groups = -(-m // rows)
    rows = -(-m // groups)
    cols_max = min(vocab, (budget - rows * acc_row) // (rows * itemsize))
    if cols_max < min(vocab, COL_MIN_COLS):
        return None
    if cols_max < vocab and cols_max >= 8:
        cols_max = cols_max // 8 * 8  # room for tiles of whole 16-byte rows
    tiles = -(-vocab // cols_max)
    cols = -(-vocab // tiles)  # evened out: no sliver of a last tile
    aligned = -(-cols // 8) * 8
    return ColumnPlan(rows, aligned if aligned <= cols_max else cols)


def _grad_pass_columns(hidden, weight, bias, labels, out, plan: ColumnPlan, need, transform,
                       extras, *, g_lp=None, g_ent=None):
    """:func:`_grad_pass` by tiles of all a group's rows and ``plan.cols`` vocabulary columns.

    Per group of rows (one group up to :data:`COL_GROUP_ROWS` rows), per tile of columns
    ``c``: ``x = h_g @ W_c.T (+ b_c)``; the row kernel overwrites it with ``dL/dx`` (the
    statistics saved by forward hold for every tile; the target column goes to ``coef_r`` in
    the tile that holds it); ``dW_c = x.T @ h_g`` (the first group writes it, later groups add:
    dW is read and written once a group, not once per row chunk); ``db_c += x.sum(0)``;
    ``acc += x @ W_c`` (float32 ``[rows, H]``). Then ``acc += coef_r W[y_r]`` and ``dH[rows]``
    is ``acc`` rounded once; at the end ``dW[y] += sum coef_r h_r`` as :func:`_grad_pass`.
    Same products as the row chunks (4 a logit), other float32 summation orders."""
    m, hsize = hidden.shape
    vocab, dev = weight.shape[0], hidden.device
    need_h, need_w, need_b = need
    grads = _Grads(
        dh=torch.empty(m, hsize, dtype=hidden.dtype, device=dev) if need_h else None,
        dw=torch.empty_like(weight, memory_format=torch.contiguous_format) if need_w else None,
        db=torch.zeros(vocab, dtype=torch.float32, device=dev) if need_b else None,
    )
    if need_w and m == 0:
        grads.dw.zero_()
    coef = torch.zeros(m, dtype=torch.float32, device=dev)
    acc = torch.empty(min(plan.rows, m), hsize, dtype=torch.float32, device=dev) if need_h else None
    for r0 in range(0, m, plan.rows):
        r1 = min(m, r0 + plan.rows)
        h, y = hidden[r0:r1], labels[r0:r1]
        part = tuple(None if t is None else t[r0:r1] for t in out)
        a = None if acc is None else acc[: r1 - r0].zero_()
        for c0 in range(0, vocab, plan.cols):
            c1 = min(vocab, c0 + plan.cols)
            w_c = weight[c0:c1]
            z = _logits(h, w_c, None if bias is None else bias[c0:c1])
            _launch(z, y, part, coef[r0:r1], stats=False, grad=True, extras=extras,
                    transform=transform, g_lp=None if g_lp is None else g_lp[r0:r1],
                    g_ent=None if g_ent is None else g_ent[r0:r1], col0=c0)
            if need_w and r0 == 0:
                torch.mm(z.t(), h, out=grads.dw[c0:c1])
            elif need_w:
                grads.dw[c0:c1].addmm_(z.t(), h)
            if need_b:
                grads.db[c0:c1] += z.sum(0, dtype=torch.float32)
            if need_h:
                _addmm_fp32_(a, z, w_c)
            del z
        if need_h:  # dH[g] = acc + coef_r W[y_r], in float32, rounded once
            CUDA_LAUNCHERS.dhidden_rows(grads.dh, torch.arange(r0, r1, device=dev), part=a,
                                        coef=coef[r0:r1], labels=y, weight=weight)
    _finish(grads, hidden, labels, coef)
    return grads


class TritonTokenStats(torch.autograd.Function):
    """``apply(hidden [M, H], weight, bias, labels [M], transform, extras, rows, hint,
    budget)`` →
    ``(log_probs, entropy, is_top1, mean_logits, log_sum_sq_probs)``, each ``[M]`` or None
    (as :class:`~fused_ce_patch.backends.token_stats.TokenStatsFunction`); every label is
    counted. ``hint``: a :class:`~fused_ce_patch.token_stats.ForwardGradHint` or None;
    ``budget``: bytes of logits a chunk may hold (the backward's column tiles plan with it)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, transform, extras, rows, hint, budget):
        m, dev = hidden.shape[0], hidden.device

        def vec(name, dtype=torch.float32):
            return torch.empty(m, dtype=dtype, device=dev) if name in extras else None

        mx = torch.empty(m, dtype=torch.float32, device=dev)
        log_s = torch.empty(m, dtype=torch.float32, device=dev)
        nll = torch.empty(m, dtype=torch.float32, device=dev)
        out = (mx, log_s, nll, vec("entropy"), vec("is_top1", torch.int8), vec("mean_logits"),
               vec("log_sum_sq_probs"))
        # (forward runs with grad mode off; needs_input_grad says what backward will need)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2])
        eager = (any(need) and hint is not None and hint.on
                 and forward_grad_safe(hidden.dtype))
        grads = _new_grads(hidden, weight, bias, need) if eager else None
        coef = torch.empty(m, dtype=torch.float32, device=dev) if eager else None
        for r0 in range(0, m, rows):
            r1 = min(m, r0 + rows)
            h, y = hidden[r0:r1], labels[r0:r1]
            z = _logits(h, weight, bias)
            part = tuple(None if t is None else t[r0:r1] for t in out)
            _launch(z, y, part, None if coef is None else coef[r0:r1], stats=True, grad=eager,
                    extras=extras, transform=transform, g_lp_value=1.0)
            if eager:
                _backprop_chunk(z, h, None, y, coef[r0:r1], weight, grads, slice(r0, r1))
            del z
        if eager:
            _finish(grads, hidden, labels, coef)
        mx, log_s, nll, ent, top1, mean, sq = out
        log_probs = -nll
        is_top1 = None if top1 is None else top1.bool()
        ctx.transform, ctx.extras, ctx.rows, ctx.hint = transform, extras, rows, hint
        ctx.budget = budget
        ctx.grads = grads
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, mx, log_s, nll, ent)
        ctx.mark_non_differentiable(*(x for x in (is_top1, mean, sq) if x is not None))
        return log_probs, ent, is_top1, mean, sq

    @staticmethod
    @single_backward
    def backward(ctx, g_lp, g_ent, *_non_differentiable):
        hidden, weight, bias, labels, mx, log_s, nll, ent = ctx.saved_tensors
        grads, ctx.grads = ctx.grads, None
        if g_lp is None and g_ent is None:
            return (None,) * 9
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2])
        if grads is not None:
            c = _uniform_value(g_lp) if g_ent is None else None
            if c is not None:
                for t in (grads.dh, grads.dw, grads.db):
                    if t is not None and c != 1.0:
                        t.mul_(c)
                return _outputs(grads, need, bias)
            del grads
            if ctx.hint is not None and ctx.hint.on:
                ctx.hint.on = False
                logger.info("fused_ce_patch: the log-probabilities' upstream gradient differs "
                            "between positions; this caller's token statistics now form "
                            "their gradient in backward")
        saved = (mx, log_s, nll, ent, None, None, None)
        g_lp = None if g_lp is None else g_lp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        plan = plan_columns(hidden.shape[0], hidden.shape[1], weight.shape[0],
                            hidden.element_size(), ctx.budget)
        if plan is not None:
            grads = _grad_pass_columns(hidden, weight, bias, labels, saved, plan, need,
                                       ctx.transform, ctx.extras, g_lp=g_lp, g_ent=g_ent)
        else:
            grads = _grad_pass(hidden, weight, bias, labels, saved, ctx.rows, need,
                               ctx.transform, ctx.extras, g_lp=g_lp, g_ent=g_ent)
        return _outputs(grads, need, bias)


def _uniform_value(g: torch.Tensor | None) -> float | None:
    """The one finite value of every entry of ``g`` (0 when ``g`` is None or empty), else
    None. One host sync."""
    if g is None or g.numel() == 0:
        return 0.0
    first = g.reshape(-1)[0]
    same = torch.all(g == first) & torch.isfinite(first)
    ok, value = torch.stack((same.double(), first.double())).tolist()
    return value if ok else None


def _outputs(grads: _Grads, need, bias):
    dh = grads.dh if need[0] else None
    dw = grads.dw if need[1] else None
    db = grads.db.to(bias.dtype) if (need[2] and grads.db is not None) else None
    return dh, dw, db, None, None, None, None, None, None


def token_stats_triton(hidden, weight, bias, labels, transform, extras, budget, hint=None):
    """Run :class:`TritonTokenStats` on ``[M, H]`` counted rows with ``budget`` bytes of logits
    per chunk; returns None when fewer than 16 rows (or all ``M``) fit, for the caller's
    tiled fallback."""
    m, vocab = hidden.shape[0], weight.shape[0]
    rows_max = rows_per_chunk(m, vocab, hidden.dtype, budget)
    if rows_max < min(16, max(m, 1)):
        return None
    rows = plan_rows(max(m, 1), rows_max)
    if not torch.is_grad_enabled():
        hint = None  # no backward will come: never form a gradient in forward
    # the kernel reads one label per row at unit stride
    return TritonTokenStats.apply(hidden, weight, bias, labels.contiguous(), transform,
                                  frozenset(extras), rows, hint, budget)

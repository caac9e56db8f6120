"""Triton row kernel of :func:`fused_ce_patch.fused_linear_token_stats` on backend ``"triton"``.

One program per row of a ``[r, V]`` logits chunk ``x = h W^T (+ b)`` (input dtype, made by a
cuBLAS matmul in :mod:`.token_stats`). With ``z = T(x) = c * tanh(s * x / c) / t`` (logit scale
``s``, softcap ``c``, temperature ``t``; docs/design.md), it can do two passes over the row:

- *stats* (``STATS``): each block of ``BLOCK_V`` columns is read as ``SUB_ROWS`` segments
  with a running max each (as the loss kernel's LSE pass, ``kernels._lse_step_rows``: no
  step waits on a reduction across the program's warps), with per-lane sums ``sum e``,
  ``sum e (z - m)``, ``sum e^2`` (``e = exp(z - m)``) and ``sum z``, and a per-lane first
  maximum. The segments combine once at the end, giving ``m`` and ``log_s = log sum e``
  (kept apart: ``LSE = m + log_s`` rounded to float32 would put an error of ``ulp(LSE)`` on
  every ``p``), ``nll = (m - z_y) + log_s``, ``H = log_s - sum e (z - m) / sum e``,
  ``is_top1`` (first argmax, like ``torch.argmax``, except that NaN columns are passed over
  where ``torch.argmax`` picks the first NaN), ``mean z`` and
  ``log sum p^2 = log sum e^2 - 2 log sum e``.
- *grad* (``GRAD``): overwrites the row with the dense part of ``dL/dx`` for
  ``L = g_lp * log p_y + g_H * H``::

      dL/dz_v = g_lp * (1[v = y] - p_v) - g_H * p_v * (log p_v + H)
      dL/dx_v = dL/dz_v * (s / t) * (1 - tanh^2)

  written in the input dtype with 0 in the target column, whose value goes to ``coef[row]``
  in float32 (as the loss kernel does, kernels module docstring), with ``1 - p_y`` formed as
  ``-expm1(-nll)`` so that confident rows (``p_y ~ 1``) keep their digits.
  ``ENTROPY_IN_GRAD`` (both passes in one launch, no entropy gradient: the SFT schedule of
  :mod:`.token_stats`): the entropy comes from this pass's ``p`` as
  ``H = log_s - sum p (z - m) / sum p`` and the stats pass skips its ``sum e (z - m)``, the
  costlier of its sums (the stats pass is bound by instruction issue).

``g_lp`` is absent, one value for every row, or one per row (``G_LP`` = 0, 1, 2); ``g_H`` is
absent or per row. ``FAST_MATH`` (NVIDIA): the per-logit ``exp`` and the softcap's reciprocal
by PTX approximations, as the loss kernel (kernels module docstring). Sources: as the loss
kernels (online softmax, Milakov & Gimelshein 2018); the entropy gradient
``-p_v (log p_v + H)`` is the derivative of ``-sum p log p``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _NEG_BIG, _cast, _exp, _one_minus_exp_neg, _tanh_and_slope


@triton.jit
def _transform(x, in_scale, out_scale, HAS_SOFTCAP: tl.constexpr, FAST: tl.constexpr):
    """``(z, slope)``: ``z = T(x)`` in float32 and, with softcap, ``1 - tanh^2`` (else 1).

    ``in_scale`` / ``out_scale`` are ``s / c`` and ``c / t`` with softcap (``z = (c / t) *
    tanh(x * s / c)``), else ``s / t`` and unused: two products a logit, not a division."""
    if HAS_SOFTCAP:
        th, slope = _tanh_and_slope(x * in_scale, FAST)
        z = out_scale * th
    else:
        z = x * in_scale
        slope = 1.0
    return z, slope


@triton.jit
def _stats_step(z_row, idx, vocab, in_scale, out_scale, m, s, s_ez, s_ee, s_z, best, best_at,
                HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, TOP1: tl.constexpr,
                MEAN: tl.constexpr, SQ: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """One block of the stats pass over ``[SUB_ROWS, W]`` segments of a row (``idx``: their
    columns): one running max per segment (``m``, ``[SUB_ROWS]``), per-lane sums."""
    mask = idx < vocab
    x = tl.load(z_row + idx, mask=mask, other=0.0).to(tl.float32)
    z, _ = _transform(x, in_scale, out_scale, HAS_SOFTCAP, FAST)
    zm = tl.where(mask, z, -float("inf"))
    m_new = tl.maximum(m, tl.max(zm, axis=1))
    alpha = _exp(m - m_new, FAST)[:, None]
    e = _exp(zm - m_new[:, None], FAST)  # 0 in masked lanes
    if ENTROPY:
        # sum e (z - m), moved to the new max: no cancellation against a large LSE
        s_ez = ((s_ez + (m - m_new)[:, None] * s) * alpha
                + tl.where(mask, e * (z - m_new[:, None]), 0.0))  # fmt: skip
    s = s * alpha + e
    if SQ:
        s_ee = s_ee * (alpha * alpha) + e * e
    if MEAN:
        s_z += tl.where(mask, z, 0.0)
    if TOP1:
        # strictly greater: within a lane the earlier column keeps a tie
        better = zm > best
        best = tl.where(better, zm, best)
        best_at = tl.where(better, idx, best_at)
    return m_new, s, s_ez, s_ee, s_z, best, best_at


@triton.jit
def _stats_row(z_row, x_y, vocab, in_scale, out_scale, HAS_SOFTCAP: tl.constexpr,
               ENTROPY: tl.constexpr, TOP1: tl.constexpr, MEAN: tl.constexpr,
               SQ: tl.constexpr, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr,
               SUB_ROWS: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """``(max, log sum e, nll, entropy, first argmax, mean, log_sum_sq)`` of one row whose
    target's raw logit is ``x_y`` (unrequested ones are 0). Each block is read as
    ``SUB_ROWS`` segments with a running max each, as the loss kernel's LSE pass
    (``kernels._lse_step_rows``): no step waits on a reduction across the program's warps;
    the segments are combined once at the end."""
    W: tl.constexpr = BLOCK_V // SUB_ROWS
    offs = tl.arange(0, SUB_ROWS)[:, None] * W + tl.arange(0, W)[None, :]
    m = tl.full([SUB_ROWS], _NEG_BIG, tl.float32)
    s = tl.zeros([SUB_ROWS, W], tl.float32)
    s_ez = tl.zeros([SUB_ROWS, W], tl.float32)
    s_ee = tl.zeros([SUB_ROWS, W], tl.float32)
    s_z = tl.zeros([SUB_ROWS, W], tl.float32)
    best = tl.full([SUB_ROWS, W], -float("inf"), tl.float32)
    best_at = tl.zeros([SUB_ROWS, W], tl.int32)
    if NUM_STAGES > 1:
        for v0 in tl.range(0, vocab, BLOCK_V, num_stages=NUM_STAGES):
            m, s, s_ez, s_ee, s_z, best, best_at = _stats_step(
                z_row, v0 + offs, vocab, in_scale, out_scale, m, s, s_ez, s_ee, s_z, best,
                best_at, HAS_SOFTCAP, ENTROPY, TOP1, MEAN, SQ, FAST)
    else:
        for v0 in range(0, vocab, BLOCK_V):
            m, s, s_ez, s_ee, s_z, best, best_at = _stats_step(
                z_row, v0 + offs, vocab, in_scale, out_scale, m, s, s_ez, s_ee, s_z, best,
                best_at, HAS_SOFTCAP, ENTROPY, TOP1, MEAN, SQ, FAST)
    # segments to the row's max: a segment's sums scale by f = exp(m_seg - m) (0 for a
    # segment that saw no column: its max stayed at the finite _NEG_BIG)
    m_seg = m
    m = tl.max(m_seg, axis=0)
    f = tl.exp(m_seg - m)
    s_seg = tl.sum(s, axis=1)
    total = tl.sum(s_seg * f, axis=0)
    log_s = tl.log(total)
    z_y, _ = _transform(x_y, in_scale, out_scale, HAS_SOFTCAP, FAST)
    nll = (m - z_y) + log_s
    ent = 0.0
    if ENTROPY:
        # sum e (z - m) = sum_seg f (sum e_seg (z - m_seg) + (m_seg - m) sum e_seg); the
        # difference is dropped where f = 0 (a segment that saw no column, or one far below
        # a +inf logit, where it is infinite)
        d = tl.where(f > 0.0, m_seg - m, 0.0)
        ent = log_s - tl.sum(f * (tl.sum(s_ez, axis=1) + d * s_seg), axis=0) / total
    first = 0
    if TOP1:
        top = tl.max(tl.max(best, axis=1), axis=0)
        first = tl.min(tl.min(tl.where(best == top, best_at, vocab), axis=1), axis=0)
    mean = 0.0
    if MEAN:
        mean = tl.sum(tl.sum(s_z, axis=1), axis=0) / vocab
    log_sq = 0.0
    if SQ:
        log_sq = tl.log(tl.sum(tl.sum(s_ee, axis=1) * (f * f), axis=0)) - 2.0 * log_s
    return m, log_s, nll, ent, first, mean, log_sq


@triton.jit
def _stats_grad_step(z_row, v0, cols, vocab, y32, m, log_s, ent, g_lp, g_ent, chain, in_scale,
                     out_scale, s_p, s_pz, HAS_SOFTCAP: tl.constexpr, G_ENT: tl.constexpr,
                     ENT_SUM: tl.constexpr, FIX_RNE: tl.constexpr,
                     FAST: tl.constexpr):  # fmt: skip
    """One block of a row overwritten with ``dL/dx`` (0 in the target column); ``ENT_SUM``:
    adds ``p`` and ``p (z - m)`` to the per-lane sums ``s_p``, ``s_pz`` (returned)."""
    mask = cols < vocab - v0
    x = tl.load(z_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
    z, slope = _transform(x, in_scale, out_scale, HAS_SOFTCAP, FAST)
    z_m = z - m
    log_p = z_m - log_s  # LSE = m + log_s, never rounded
    p = _exp(log_p, FAST)
    g = -(g_lp * p)
    if G_ENT:
        g -= g_ent * p * (log_p + ent)
    g = g * chain
    if HAS_SOFTCAP:
        g = g * slope
    g = tl.where(cols == y32 - v0, 0.0, g)
    tl.store(z_row + v0 + cols, _cast(g, z_row.dtype.element_ty, FIX_RNE), mask=mask)
    if ENT_SUM:
        p = tl.where(mask, p, 0.0)
        s_p += p
        s_pz += p * z_m
    return s_p, s_pz


@triton.jit
def token_stats_row_kernel(
    z_ptr,
    stride_z,
    labels_ptr,
    max_ptr,
    log_s_ptr,
    nll_ptr,
    ent_ptr,
    top1_ptr,
    mean_ptr,
    sq_ptr,
    coef_ptr,
    g_lp_ptr,
    g_lp_value,
    g_ent_ptr,
    vocab,
    logit_scale,
    softcap,
    temperature,
    col0,
    HAS_SOFTCAP: tl.constexpr,
    STATS: tl.constexpr,
    ENTROPY: tl.constexpr,
    TOP1: tl.constexpr,
    MEAN: tl.constexpr,
    SQ: tl.constexpr,
    GRAD: tl.constexpr,
    G_LP: tl.constexpr,
    G_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FIX_RNE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SUB_ROWS: tl.constexpr = 1,
    FAST_MATH: tl.constexpr = False,
    ENTROPY_IN_GRAD: tl.constexpr = False,
    COL_TILE: tl.constexpr = False,
):
    """Statistics and/or the logits gradient of one row of a ``[r, V]`` chunk (module
    docstring). Grid ``(r,)``.

    ``STATS``: writes the row's max ``m``, ``log_s`` (``LSE = m + log_s``), ``nll`` and the
    requested ``ent`` / ``top1`` (int8) / ``mean``
    / ``sq`` (float32 ``[r]``); otherwise ``m``, ``log_s``, ``nll`` (and ``ent`` when
    ``G_ENT``) are read. ``GRAD``: overwrites the row with ``dL/dx`` (0 in the target column)
    and writes the target column's value to ``coef[row]``.

    ``COL_TILE`` (``GRAD`` only): the chunk holds the vocabulary columns ``[col0, col0 +
    vocab)`` of every row (the column-tiled backward of :mod:`.token_stats`); the statistics
    are read, and ``coef[row]`` is written only by the tile that holds the row's target.
    """
    row = tl.cast(tl.program_id(0), tl.int64)
    z_row = z_ptr + row * stride_z
    y = tl.load(labels_ptr + row)
    if COL_TILE:
        y = y - col0  # the target's column within this tile (outside [0, vocab): elsewhere)
        in_tile = (y >= 0) & (y < vocab)
        x_y = tl.load(z_row + y, mask=in_tile, other=0.0).to(tl.float32)
    else:
        x_y = tl.load(z_row + y).to(tl.float32)  # before the grad pass overwrites the row
    if HAS_SOFTCAP:
        in_scale = logit_scale / softcap
        out_scale = softcap / temperature
    else:
        in_scale = logit_scale / temperature
        out_scale = 1.0
    if STATS:
        m, log_s, nll, ent, first, mean, log_sq = _stats_row(
            z_row, x_y, vocab, in_scale, out_scale, HAS_SOFTCAP,
            ENTROPY and not ENTROPY_IN_GRAD, TOP1, MEAN, SQ, BLOCK_V, NUM_STAGES, SUB_ROWS,
            FAST_MATH)  # fmt: skip
        tl.store(max_ptr + row, m)
        tl.store(log_s_ptr + row, log_s)
        tl.store(nll_ptr + row, nll)
        if ENTROPY and not ENTROPY_IN_GRAD:
            tl.store(ent_ptr + row, ent)
        if TOP1:
            tl.store(top1_ptr + row, (first == y).to(tl.int8))
        if MEAN:
            tl.store(mean_ptr + row, mean)
        if SQ:
            tl.store(sq_ptr + row, log_sq)
    else:
        m = tl.load(max_ptr + row)
        log_s = tl.load(log_s_ptr + row)
        nll = tl.load(nll_ptr + row)
        ent = 0.0
        if G_ENT:
            ent = tl.load(ent_ptr + row)

    if GRAD:
        g_lp = 0.0
        if G_LP == 1:
            g_lp = g_lp_value
        elif G_LP == 2:
            g_lp = tl.load(g_lp_ptr + row).to(tl.float32)
        g_ent = 0.0
        if G_ENT:
            g_ent = tl.load(g_ent_ptr + row).to(tl.float32)
        chain = logit_scale / temperature
        y32 = tl.cast(y, tl.int32)
        cols = tl.arange(0, BLOCK_V)
        s_p = tl.zeros([BLOCK_V], tl.float32)
        s_pz = tl.zeros([BLOCK_V], tl.float32)
        if NUM_STAGES > 1:
            for v0 in tl.range(0, vocab, BLOCK_V, num_stages=NUM_STAGES):
                s_p, s_pz = _stats_grad_step(z_row, v0, cols, vocab, y32, m, log_s, ent, g_lp,
                                             g_ent, chain, in_scale, out_scale, s_p, s_pz,
                                             HAS_SOFTCAP, G_ENT, ENTROPY_IN_GRAD, FIX_RNE,
                                             FAST_MATH)  # fmt: skip
        else:
            for v0 in range(0, vocab, BLOCK_V):
                s_p, s_pz = _stats_grad_step(z_row, v0, cols, vocab, y32, m, log_s, ent, g_lp,
                                             g_ent, chain, in_scale, out_scale, s_p, s_pz,
                                             HAS_SOFTCAP, G_ENT, ENTROPY_IN_GRAD, FIX_RNE,
                                             FAST_MATH)  # fmt: skip
        if ENTROPY_IN_GRAD:
            # H = log_s - sum p (z - m) / sum p, the stats pass's form with p for e: log_s
            # cancels against log p's in the entropy gradient -p (log p + H), which
            # -sum p log p would not let it do (its error then enters that gradient whole)
            ent = log_s - tl.sum(s_pz, axis=0) / tl.sum(s_p, axis=0)
            tl.store(ent_ptr + row, ent)
        # the target column, in float32: p_y = exp(-nll), 1 - p_y = -expm1(-nll)
        coef = g_lp * _one_minus_exp_neg(tl.maximum(nll, 0.0))
        if G_ENT:
            coef -= g_ent * tl.exp(-nll) * (ent - nll)
        coef = coef * chain
        if HAS_SOFTCAP:
            _, slope_y = _transform(x_y, in_scale, out_scale, HAS_SOFTCAP, FAST_MATH)
            coef = coef * slope_y
        if COL_TILE:
            tl.store(coef_ptr + row, coef, mask=in_tile)
        else:
            tl.store(coef_ptr + row, coef)

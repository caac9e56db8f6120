"""Triton row kernel of :func:`fused_ce_patch.fused_linear_token_stats` on backend ``"triton"``.

One program per row of a ``[r, V]`` logits chunk ``x = h W^T (+ b)`` (input dtype, made by a
cuBLAS matmul in :mod:`.token_stats`). With ``z = T(x) = c * tanh(s * x / c) / t`` (logit scale
``s``, softcap ``c``, temperature ``t``; docs/design.md), it can do two passes over the row:

- *stats* (``STATS``): a running max ``m`` with per-lane sums ``sum e``, ``sum e (z - m)``,
  ``sum e^2`` (``e = exp(z - m)``) and ``sum z``, and a per-lane first maximum, giving
  ``m`` and ``log_s = log sum e`` (kept apart: ``LSE = m + log_s`` rounded to float32 would
  put an error of ``ulp(LSE)`` on every ``p``), ``nll = (m - z_y) + log_s``,
  ``H = log_s - sum e (z - m) / sum e``, ``is_top1`` (first argmax, like ``torch.argmax``),
  ``mean z`` and ``log sum p^2 = log sum e^2 - 2 log sum e``.
- *grad* (``GRAD``): overwrites the row with the dense part of ``dL/dx`` for
  ``L = g_lp * log p_y + g_H * H``::

      dL/dz_v = g_lp * (1[v = y] - p_v) - g_H * p_v * (log p_v + H)
      dL/dx_v = dL/dz_v * (s / t) * (1 - tanh^2)

  written in the input dtype with 0 in the target column, whose value goes to ``coef[row]``
  in float32 (as the loss kernel does, kernels module docstring), with ``1 - p_y`` formed as
  ``-expm1(-nll)`` so that confident rows (``p_y ~ 1``) keep their digits.

``g_lp`` is absent, one value for every row, or one per row (``G_LP`` = 0, 1, 2); ``g_H`` is
absent or per row. Sources: as the loss kernels (online softmax, Milakov & Gimelshein 2018);
the entropy gradient ``-p_v (log p_v + H)`` is the derivative of ``-sum p log p``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fused_ce_patch.backends.triton.kernels import _NEG_BIG, _cast, _one_minus_exp_neg, _tanh_and_slope


@triton.jit
def _transform(x, logit_scale, softcap, temperature, HAS_SOFTCAP: tl.constexpr):
    """``z = T(x)`` in float32."""
    u = x * logit_scale
    if HAS_SOFTCAP:
        t, _ = _tanh_and_slope(u * (1.0 / softcap))
        u = softcap * t
    return u / temperature


@triton.jit
def _stats_row(z_row, cols, x_y, vocab, logit_scale, softcap, temperature,
               HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, TOP1: tl.constexpr,
               MEAN: tl.constexpr, SQ: tl.constexpr, BLOCK_V: tl.constexpr,
               NUM_STAGES: tl.constexpr):  # fmt: skip
    """``(max, log sum e, nll, entropy, first argmax, mean, log_sum_sq)`` of one row whose
    target's raw logit is ``x_y`` (unrequested ones are 0)."""
    m = tl.max(tl.full([BLOCK_V], _NEG_BIG, tl.float32), axis=0)
    s = tl.zeros([BLOCK_V], tl.float32)
    s_ez = tl.zeros([BLOCK_V], tl.float32)
    s_ee = tl.zeros([BLOCK_V], tl.float32)
    s_z = tl.zeros([BLOCK_V], tl.float32)
    best = tl.full([BLOCK_V], -float("inf"), tl.float32)
    best_at = tl.zeros([BLOCK_V], tl.int32)
    for v0 in tl.range(0, vocab, BLOCK_V, num_stages=NUM_STAGES):
        mask = cols < vocab - v0
        x = tl.load(z_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
        z = _transform(x, logit_scale, softcap, temperature, HAS_SOFTCAP)
        zm = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(zm, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(zm - m_new)  # 0 in masked lanes
        if ENTROPY:
            # sum e (z - m), moved to the new max: no cancellation against a large LSE
            s_ez = (s_ez + (m - m_new) * s) * alpha + tl.where(mask, e * (z - m_new), 0.0)
        s = s * alpha + e
        if SQ:
            s_ee = s_ee * (alpha * alpha) + e * e
        if MEAN:
            s_z += tl.where(mask, z, 0.0)
        if TOP1:
            # strictly greater: within a lane the earlier column keeps a tie
            better = zm > best
            best = tl.where(better, zm, best)
            best_at = tl.where(better, v0 + cols, best_at)
        m = m_new
    total = tl.sum(s, axis=0)
    log_s = tl.log(total)
    z_y = _transform(x_y, logit_scale, softcap, temperature, HAS_SOFTCAP)
    nll = (m - z_y) + log_s
    ent = 0.0
    if ENTROPY:
        ent = log_s - tl.sum(s_ez, axis=0) / total
    first = 0
    if TOP1:
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(best == top, best_at, vocab), axis=0)
    mean = 0.0
    if MEAN:
        mean = tl.sum(s_z, axis=0) / vocab
    log_sq = 0.0
    if SQ:
        log_sq = tl.log(tl.sum(s_ee, axis=0)) - 2.0 * log_s
    return m, log_s, nll, ent, first, mean, log_sq


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
):
    """Statistics and/or the logits gradient of one row of a ``[r, V]`` chunk (module
    docstring). Grid ``(r,)``.

    ``STATS``: writes the row's max ``m``, ``log_s`` (``LSE = m + log_s``), ``nll`` and the
    requested ``ent`` / ``top1`` (int8) / ``mean``
    / ``sq`` (float32 ``[r]``); otherwise ``m``, ``log_s``, ``nll`` (and ``ent`` when
    ``G_ENT``) are read. ``GRAD``: overwrites the row with ``dL/dx`` (0 in the target column)
    and writes the target column's value to ``coef[row]``.
    """
    row = tl.cast(tl.program_id(0), tl.int64)
    z_row = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    y = tl.load(labels_ptr + row)
    x_y = tl.load(z_row + y).to(tl.float32)  # before the grad pass overwrites the row
    if STATS:
        m, log_s, nll, ent, first, mean, log_sq = _stats_row(
            z_row, cols, x_y, vocab, logit_scale, softcap, temperature, HAS_SOFTCAP,
            ENTROPY, TOP1, MEAN, SQ, BLOCK_V, NUM_STAGES)
        tl.store(max_ptr + row, m)
        tl.store(log_s_ptr + row, log_s)
        tl.store(nll_ptr + row, nll)
        if ENTROPY:
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
        for v0 in tl.range(0, vocab, BLOCK_V, num_stages=NUM_STAGES):
            mask = cols < vocab - v0
            x = tl.load(z_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
            u = x * logit_scale
            if HAS_SOFTCAP:
                t, slope = _tanh_and_slope(u * (1.0 / softcap))
                u = softcap * t
            log_p = (u / temperature - m) - log_s  # LSE = m + log_s, never rounded
            p = tl.exp(log_p)
            g = -(g_lp * p)
            if G_ENT:
                g -= g_ent * p * (log_p + ent)
            g = g * chain
            if HAS_SOFTCAP:
                g = g * slope
            g = tl.where(cols == y32 - v0, 0.0, g)
            tl.store(z_row + v0 + cols, _cast(g, z_row.dtype.element_ty, FIX_RNE), mask=mask)
        # the target column, in float32: p_y = exp(-nll), 1 - p_y = -expm1(-nll)
        coef = g_lp * _one_minus_exp_neg(tl.maximum(nll, 0.0))
        if G_ENT:
            coef -= g_ent * tl.exp(-nll) * (ent - nll)
        coef = coef * chain
        if HAS_SOFTCAP:
            _, slope_y = _tanh_and_slope(x_y * logit_scale * (1.0 / softcap))
            coef = coef * slope_y
        tl.store(coef_ptr + row, coef)

"""Triton kernels of backends ``"triton"`` (CUDA/ROCm) and ``"ascend"`` (triton-ascend), one
source for both; the Triton interpreter runs them in CI.

Every kernel works on *counted* rows only (labels already validated by ``loss.py``; no kernel
asserts on the device). Offsets that can exceed 2**31 are formed in int64: a row's or tile's
base offset as an int64 scalar (``tl.cast``, which also takes compile-time constants) added to
int32 in-block indices, plus the per-row element offsets of ``hidden`` (``row_off``, int64,
for any strides). All reductions accumulate in float32.

The gradient of a row's loss with respect to its logits, ``scale * dL/dz_v`` with::

    dL/ds_v = p_v * (1 + 2 * z_loss * LSE) - eps / V - (1 - eps) * 1[v = y]

(``s`` the softcapped logits, times ``ds/dz = 1 - tanh(z / c)**2`` through a softcap ``c``),
is split by column: the *dense* part, every column except the target, is what the kernels
write (in the input dtype) and what the matmuls consume; the *target column* is one float32
coefficient per row, ``coef_r = scale_r * dL/dz_{r, y_r}``, added in float32 to dW
(``dW[y] += sum_{r: y_r = y} coef_r * h_r``, :func:`target_dweight_kernel`) and, on the
zero-logits path, to dH (``dH_r += coef_r * W[y_r]``, :func:`dhidden_rows_store_kernel`); the
chunked path writes it into its logits chunk before the dH matmul instead, so that dH is
rounded once, as in PyTorch. On large vocabularies the target column carries most of the
gradient's norm, so adding it in float32 instead of through bf16 partial sums keeps dW's
error below PyTorch's own bf16 path; and it is formed in float32 from the unrounded
``nll = LSE - z_y`` (``exp(z_y - LSE)`` would let LSE's float32 rounding dominate ``p_y - 1``
for confident rows): from ``1 - p_y = -expm1(-nll)`` (:func:`_one_minus_exp_neg`) when
``p_y > 1/2`` (``exp(-nll) - 1`` would lose digits), from ``p_y = exp(-nll)`` otherwise (the
``1 - p_y`` form cancels the z-loss factor ``1 + 2 lambda LSE`` against itself when it is large).

Softcap: ``c * tanh(z / c)`` and its slope ``1 - tanh**2`` come from :func:`_tanh_and_slope`,
accurate to a few float32 ulps over the whole range: the usual ``1 - 2 / (exp(2u) + 1)``
cancels for ``|u| << 1`` (a softcap of 1e8 on logits of order 1 lost every digit), so small
``|u|`` take a short odd series, and the slope is ``4e / (1 + e)**2`` with ``e = exp(-2|u|)``,
which never cancels nor overflows. (``tanh`` itself is in neither upstream ``tl`` nor
triton-ascend's op table.)

Device differences are compile-time switches, set by the launchers (``launch.py`` here and
``ascend/launch.py``):

- ``PERSISTENT`` (ascend): triton-ascend binds a program to a physical core, runs programs
  beyond the core count in further rounds at a cost, and limits a grid axis to 65535. Its
  launches are one program per core, each looping over rows or tiles
  (``range(pid, n, num_programs)``); CUDA launches one program per row or tile.
- ``LANE_SUMS`` (CUDA): the row kernel's running sums are per-lane vectors (one reduction per
  row); ascend keeps scalars (one reduction per block) so fewer tiles are live in its Unified
  Buffer. ``NUM_STAGES > 1`` (CUDA) software-pipelines the row loops with ``tl.range``; the
  ascend launch passes 1 (plain ``range``, as triton-ascend's guides write loops).
  ``SUB_ROWS > 1`` (CUDA, :func:`_lse_step_rows`): the LSE pass views each block as
  ``SUB_ROWS`` segments with a running max each, so no step waits on a reduction across the
  program's warps (one combine per row).
- ``FRESH_OPERANDS`` (ascend): triton-ascend may reuse a ``tl.dot`` left operand's on-chip
  buffer for the product (flash-linear-attention notes this), so a tile that feeds several
  dots is passed as a fresh copy each time.
- ``ATOMIC_SEM``: ``"relaxed"`` on CUDA (``red.global.add``, no fence); ascend keeps Triton's
  default, the only float32 ``atomic_add`` its op table lists (return value unused).
- ``FAST_MATH`` (NVIDIA CUDA: the row kernel and the zero-logits epilogues,
  :func:`lse_cols_kernel`, :func:`logits_grad_cols_kernel`, :func:`lse_tma_kernel`,
  :func:`grad_tma_kernel`): the
  per-logit ``exp`` and the softcap's reciprocal are PTX ``ex2.approx.ftz`` / ``rcp.approx.ftz``
  (:func:`_exp`, :func:`_recip`).
  ``tl.exp`` and ``/`` compile to the same approximations wrapped in range fix-ups for
  subnormal results (5 instructions per exp, 5 per reciprocal, against 2 and 1); the row
  kernel is issue-bound with softcap, where that is 10 of ~50 instructions per logit and
  pass. Flushing is harmless there: an ``exp`` below 2**-126 is a probability (or a tanh
  complement) that the float32 sums cannot see and that rounds to 0 or to a subnormal in the
  16-bit gradient; the reciprocal's argument lies in ``[1, 2]``.
- ``ROW_ALIGN`` (CUDA): ``tl.multiple_of`` hint that lets gathered hidden-row loads be
  vectorised and pipelined; ``DOT_PRECISION``: ``"tf32"`` when torch allows it on CUDA,
  ``"ieee"`` otherwise (always on ascend).
- ``UPCAST``, ``FIX_RNE`` (the interpreter only): upstream Triton 3.9's interpreter multiplies
  bfloat16 ``tl.dot`` operands as raw 16-bit patterns and truncates float32 to bfloat16;
  there dot operands are widened to float32 first (the same products, exact) and casts to
  bfloat16 round to nearest even by hand (:func:`_cast`).

Sources: Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018) for the
running max/sum; Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (2024)
for computing the log-sum-exp from logit tiles that never leave the chip; triton-ascend
``docs/en/programming_guide.md``, ``docs/en/migration_guide/*.md`` and
``docs/sources/python-api/outline.md`` (op support table) for the NPU switches.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Start value of running maxima: finite, so that ``exp(m_old - m_new)`` never sees inf - inf.
_NEG_BIG = tl.constexpr(-1.0e30)
#: Below this ``|u|``, ``tanh(u)`` comes from its series (error < 2e-8 relative at 0.25);
#: above it, ``(1 - e) / (1 + e)`` has no cancellation worse than 2.5x.
_TANH_SERIES_MAX = tl.constexpr(0.25)
#: Below this ``a``, ``1 - exp(-a)`` comes from its series (error < 1e-13 relative).
_EXPM1_SERIES_MAX = tl.constexpr(1.0e-2)
#: ``log 2``: below this ``nll`` (``p_y > 1/2``) the target column is formed from ``1 - p_y``.
_LN2 = tl.constexpr(0.6931471805599453)
#: ``1 / log 2``: ``exp(x) = 2 ** (x * _LOG2E)``.
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp2_ftz(x):
    """``2 ** x`` of float32 ``x`` by PTX ``ex2.approx.ftz`` (NVIDIA only): results below
    2**-126 flushed to 0 (module docstring, ``FAST_MATH``)."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                     dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _exp(x, FAST: tl.constexpr):
    """``exp(x)`` of float32 ``x``; ``FAST``: by :func:`_exp2_ftz`."""
    if FAST:
        return _exp2_ftz(x * _LOG2E)
    return tl.exp(x)


@triton.jit
def _recip(x, FAST: tl.constexpr):
    """``1 / x`` of float32 ``x`` (a normal number); ``FAST`` (NVIDIA only): PTX
    ``rcp.approx.ftz`` (at most 1 ulp off, as ``/``'s own ``div.full`` is 2)."""
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
    return 1.0 / x


@triton.jit
def _one_minus_exp_neg(a):
    """``1 - exp(-a)`` for ``a >= 0`` without cancellation near 0 (``-expm1(-a)``)."""
    series = a * (1.0 - a * (0.5 - a * (0.16666666666666666 - a * 0.041666666666666664)))
    return tl.where(a < _EXPM1_SERIES_MAX, series, 1.0 - tl.exp(-a))


@triton.jit
def _tanh_and_slope(u, FAST: tl.constexpr = False):
    """``(tanh(u), 1 - tanh(u)**2)`` in float32, a few ulps from exact for every ``u``
    (module docstring). NaN propagates; ``+-inf`` give ``(+-1, 0)``. ``FAST``: :func:`_exp`
    and :func:`_recip` (a slope below 2**-126 flushes to 0)."""
    a = tl.abs(u)
    if FAST:
        e = _exp2_ftz(a * (-2.0 * _LOG2E))  # exp(-2a): rounds as (-2a) * log2(e) does
    else:
        e = tl.exp(-2.0 * a)  # in [0, 1]: cannot overflow
    a2 = a * a
    # tanh(a) = a - a^3/3 + 2a^5/15 - 17a^7/315 + 62a^9/2835 - ...
    series = a * (
        1.0
        + a2 * (-0.3333333333333333
                + a2 * (0.13333333333333333
                        + a2 * (-0.05396825396825397 + a2 * 0.021869488536155203)))
    )  # fmt: skip
    inv = _recip(1.0 + e, FAST)  # one reciprocal for both (issue-bound kernels with softcap)
    t = tl.where(a < _TANH_SERIES_MAX, series, (1.0 - e) * inv)
    return tl.where(u < 0.0, -t, t), 4.0 * e * inv * inv


@triton.jit
def _softcap(x, cap, inv_cap, FAST: tl.constexpr = False):
    """``cap * tanh(x / cap)``, with ``inv_cap = 1 / cap`` (a product, not a division per
    element)."""
    t, _ = _tanh_and_slope(x * inv_cap, FAST)
    return cap * t


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in float32 (``UPCAST``: float32 copies of the operands; module
    docstring)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _operand(x, FRESH_OPERANDS: tl.constexpr):
    """``x``, or a copy of it for use as a ``tl.dot`` operand on triton-ascend."""
    if FRESH_OPERANDS:
        return x + 0.0
    return x


@triton.jit
def _atomic_add(ptr, val, mask, ATOMIC_SEM: tl.constexpr):
    """Float32 ``atomic_add`` whose return value is unused."""
    tl.atomic_add(ptr, val, mask=mask, sem=ATOMIC_SEM)


@triton.jit
def _cast(x, dtype: tl.constexpr, FIX_RNE: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even. ``FIX_RNE`` (interpreter only) rounds the
    float32 bits first, so that the interpreter's truncating cast to bfloat16 lands on the
    round-to-nearest-even value (NaN kept)."""
    if FIX_RNE:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    return x.to(dtype)


@triton.jit
def _row_scale(scale_ptr, scale_value, row, SCALE_MODE: tl.constexpr):
    """The upstream multiplier of one row: 0 = a constant, 1 = a 0-d tensor, 2 = per row."""
    if SCALE_MODE == 0:
        scale = scale_value
    elif SCALE_MODE == 1:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = tl.load(scale_ptr + row).to(tl.float32)
    return scale


@triton.jit
def scale_unless_one_kernel(x_ptr, n, g_ptr, BLOCK: tl.constexpr, FIX_RNE: tl.constexpr):
    """``x *= g`` (``n`` contiguous elements, the product in float32, one rounding), skipped
    when ``g == 1``: ``g`` is read here, on the device, so the host never waits for it (a
    ``.item()`` in backward would stall training until the device drains its queue).
    Persistent grid over blocks of ``x``."""
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
        offs = tl.arange(0, BLOCK)
        for b in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            idx = tl.cast(b, tl.int64) * BLOCK + offs
            mask = idx < n
            x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            tl.store(x_ptr + idx, _cast(x * g, x_ptr.dtype.element_ty, FIX_RNE), mask=mask)


# -- chunked path: one row of a logits chunk ------------------------------------------------


@triton.jit
def _lse_step(z_row, v0, cols, vocab, m, s, z_sum, softcap, inv_cap, HAS_SOFTCAP: tl.constexpr,
              SMOOTHING: tl.constexpr, LANE_SUMS: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """One block of the running max / sum of exp (and sum of logits) of a row. (A per-lane
    running max, without the block-wide max per step, measured slower on an H200: one more
    exp per logit and more registers, BENCHMARKS.md.)"""
    mask = cols < vocab - v0
    x = tl.load(z_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        x = _softcap(x, softcap, inv_cap, FAST)
    if SMOOTHING:
        if LANE_SUMS:
            z_sum += tl.where(mask, x, 0.0)
        else:
            z_sum += tl.sum(tl.where(mask, x, 0.0), axis=0)
    x = tl.where(mask, x, -float("inf"))
    m_new = tl.maximum(m, tl.max(x, axis=0))
    if LANE_SUMS:
        s = s * _exp(m - m_new, FAST) + _exp(x - m_new, FAST)
    else:
        s = s * _exp(m - m_new, FAST) + tl.sum(_exp(x - m_new, FAST), axis=0)
    return m_new, s, z_sum


@triton.jit
def _lse_step_rows(z_row, v0, offs, vocab, m, s, z_sum, softcap, inv_cap,
                   HAS_SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr,
                   FAST: tl.constexpr):  # fmt: skip
    """:func:`_lse_step` over a block viewed as ``[SUB_ROWS, W]`` consecutive segments
    (``offs``): one running max per segment, reduced along the segment only (within a warp
    when each warp holds one segment), sums per lane; combined once per row."""
    idx = v0 + offs
    mask = idx < vocab
    x = tl.load(z_row + idx, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        x = _softcap(x, softcap, inv_cap, FAST)
    if SMOOTHING:
        z_sum += tl.where(mask, x, 0.0)
    x = tl.where(mask, x, -float("inf"))
    m_new = tl.maximum(m, tl.max(x, axis=1))
    s = s * _exp(m - m_new, FAST)[:, None] + _exp(x - m_new[:, None], FAST)
    return m_new, s, z_sum


@triton.jit
def _grad_step(z_row, v0, cols, vocab, y32, lse, scale, p_scale, softcap, inv_cap,
               label_smoothing, HAS_SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr,
               FIX_RNE: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """One block of a row overwritten with ``scale * dL/dz`` (0 in the target column)."""
    mask = cols < vocab - v0
    x = tl.load(z_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        t, slope = _tanh_and_slope(x * inv_cap, FAST)
        x = softcap * t
    g = _exp(x - lse, FAST) * p_scale
    if SMOOTHING:
        g -= scale * label_smoothing / vocab
    if HAS_SOFTCAP:
        g = g * slope
    g = tl.where(cols == y32 - v0, 0.0, g)
    tl.store(z_row + v0 + cols, _cast(g, z_row.dtype.element_ty, FIX_RNE), mask=mask)


@triton.jit
def _logits_grad_row(row, z_ptr, stride_z, labels_ptr, lse_ptr, nll_ptr, loss_ptr, coef_ptr,
                     scale_ptr, scale_value, vocab, softcap, label_smoothing, z_loss,
                     HAS_SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr,
                     SCALE_MODE: tl.constexpr, COMPUTE_LSE: tl.constexpr,
                     WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr, FIX_RNE: tl.constexpr,
                     NUM_STAGES: tl.constexpr, LANE_SUMS: tl.constexpr,
                     SUB_ROWS: tl.constexpr, FAST_MATH: tl.constexpr):  # fmt: skip
    r64 = tl.cast(row, tl.int64)
    z_row = z_ptr + r64 * stride_z
    cols = tl.arange(0, BLOCK_V)
    y = tl.load(labels_ptr + r64)
    z_y_raw = tl.load(z_row + y).to(tl.float32)
    z_y = z_y_raw
    inv_cap = 1.0 / softcap
    if HAS_SOFTCAP:
        t_y, slope_y = _tanh_and_slope(z_y_raw * inv_cap, FAST_MATH)  # as the row's others
        z_y = softcap * t_y

    if COMPUTE_LSE and SUB_ROWS > 1:
        W: tl.constexpr = BLOCK_V // SUB_ROWS
        offs = tl.arange(0, SUB_ROWS)[:, None] * W + tl.arange(0, W)[None, :]
        m_seg = tl.full([SUB_ROWS], _NEG_BIG, tl.float32)
        s_lane = tl.zeros([SUB_ROWS, W], tl.float32)
        z_lane = tl.zeros([SUB_ROWS, W], tl.float32)
        for v0 in tl.range(0, vocab, BLOCK_V, num_stages=NUM_STAGES):
            m_seg, s_lane, z_lane = _lse_step_rows(z_row, v0, offs, vocab, m_seg, s_lane, z_lane,
                                                   softcap, inv_cap, HAS_SOFTCAP,
                                                   SMOOTHING, FAST_MATH)  # fmt: skip
        m = tl.max(m_seg, axis=0)
        s = tl.sum(tl.sum(s_lane, axis=1) * tl.exp(m_seg - m), axis=0)
        z_sum = tl.sum(tl.sum(z_lane, axis=1), axis=0)
    elif COMPUTE_LSE:
        m = tl.max(tl.full([BLOCK_V], _NEG_BIG, tl.float32), axis=0)
        if LANE_SUMS:  # per-lane sums, one reduction per row
            s = tl.zeros([BLOCK_V], tl.float32)
            z_sum = tl.zeros([BLOCK_V], tl.float32)
        else:
            s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
            z_sum = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
        if NUM_STAGES > 1:
            for v0 in tl.range(0, vocab, BLOCK_V, num_stages=NUM_STAGES):
                m, s, z_sum = _lse_step(z_row, v0, cols, vocab, m, s, z_sum, softcap, inv_cap,
                                        HAS_SOFTCAP, SMOOTHING, LANE_SUMS,
                                        FAST_MATH)  # fmt: skip
        else:
            for v0 in range(0, vocab, BLOCK_V):
                m, s, z_sum = _lse_step(z_row, v0, cols, vocab, m, s, z_sum, softcap, inv_cap,
                                        HAS_SOFTCAP, SMOOTHING, LANE_SUMS,
                                        FAST_MATH)  # fmt: skip
        if LANE_SUMS:
            s = tl.sum(s, axis=0)
            z_sum = tl.sum(z_sum, axis=0)
    if COMPUTE_LSE:
        log_s = tl.log(s)
        lse = m + log_s
        # LSE - z_y without rounding LSE first: exact for confident rows (p_y ~ 1) in float32
        nll = (m - z_y) + log_s
        loss = nll
        if SMOOTHING:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - z_sum / vocab)
        if Z_LOSS:
            loss += z_loss * lse * lse
        tl.store(lse_ptr + r64, lse)
        tl.store(nll_ptr + r64, nll)
        tl.store(loss_ptr + r64, loss)
    else:
        lse = tl.load(lse_ptr + r64)
        nll = tl.load(nll_ptr + r64)

    if WRITE_GRAD:
        y32 = tl.cast(y, tl.int32)  # keeps the column arithmetic 32-bit (V < 2**31)
        scale = _row_scale(scale_ptr, scale_value, r64, SCALE_MODE)
        p_scale = scale
        if Z_LOSS:
            p_scale = scale * (1.0 + 2.0 * z_loss * lse)
        if NUM_STAGES > 1:
            for v0 in tl.range(0, vocab, BLOCK_V, num_stages=NUM_STAGES):
                _grad_step(z_row, v0, cols, vocab, y32, lse, scale, p_scale, softcap, inv_cap,
                           label_smoothing, HAS_SOFTCAP, SMOOTHING, FIX_RNE,
                           FAST_MATH)  # fmt: skip
        else:
            for v0 in range(0, vocab, BLOCK_V):
                _grad_step(z_row, v0, cols, vocab, y32, lse, scale, p_scale, softcap, inv_cap,
                           label_smoothing, HAS_SOFTCAP, SMOOTHING, FIX_RNE,
                           FAST_MATH)  # fmt: skip
        # p_y * p_scale - (1 - eps) * scale. p_y >= 1/2: with 1 - p_y = -expm1(-nll), as p_y - 1
        # from a float32 exp(-nll) would lose digits for confident rows (nll << 1). p_y < 1/2:
        # from p_y itself, as (p_scale - (1 - eps) * scale) - p_scale * (1 - p_y) cancels
        # p_scale against itself when the z-loss factor p_scale / scale is large
        coef = tl.where(nll < _LN2,
                        (p_scale - (1.0 - label_smoothing) * scale)
                        - p_scale * _one_minus_exp_neg(tl.maximum(nll, 0.0)),
                        tl.exp(-nll) * p_scale - (1.0 - label_smoothing) * scale)  # fmt: skip
        if SMOOTHING:
            coef -= scale * label_smoothing / vocab
        if HAS_SOFTCAP:
            coef = coef * slope_y
        tl.store(coef_ptr + r64, coef)


@triton.jit
def logits_grad_inplace_kernel(
    z_ptr,
    stride_z,
    labels_ptr,
    lse_ptr,
    nll_ptr,
    loss_ptr,
    coef_ptr,
    scale_ptr,
    scale_value,
    n_rows,
    vocab,
    softcap,
    label_smoothing,
    z_loss,
    HAS_SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
    Z_LOSS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    COMPUTE_LSE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FIX_RNE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    LANE_SUMS: tl.constexpr,
    PERSISTENT: tl.constexpr,
    SUB_ROWS: tl.constexpr = 1,
    FAST_MATH: tl.constexpr = False,
):
    """LSE, loss and the logits gradient of the rows of a ``[r, V]`` logits chunk (input
    dtype, bias included). Grid ``(r,)``, or ``(P,)`` programs looping over rows
    ``p, p + P, ...`` when ``PERSISTENT``.

    ``COMPUTE_LSE``: one pass with a running max; writes ``lse[row]``, ``nll[row]``
    (``LSE - z_y`` without rounding LSE first) and the row's loss ``loss[row]`` (float32).
    Otherwise ``lse[row]`` and ``nll[row]`` are read. ``WRITE_GRAD``: a second pass overwrites
    the row with ``scale * dL/dz`` in the input dtype, 0 in the target column, and writes that
    column's value to ``coef[row]`` (float32).
    """
    if PERSISTENT:
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            _logits_grad_row(row, z_ptr, stride_z, labels_ptr, lse_ptr, nll_ptr, loss_ptr,
                             coef_ptr, scale_ptr, scale_value, vocab, softcap, label_smoothing,
                             z_loss, HAS_SOFTCAP, SMOOTHING, Z_LOSS, SCALE_MODE, COMPUTE_LSE,
                             WRITE_GRAD, BLOCK_V, FIX_RNE, NUM_STAGES, LANE_SUMS,
                             SUB_ROWS, FAST_MATH)  # fmt: skip
    else:
        _logits_grad_row(tl.program_id(0), z_ptr, stride_z, labels_ptr, lse_ptr, nll_ptr,
                         loss_ptr, coef_ptr, scale_ptr, scale_value, vocab, softcap,
                         label_smoothing, z_loss, HAS_SOFTCAP, SMOOTHING, Z_LOSS, SCALE_MODE,
                         COMPUTE_LSE, WRITE_GRAD, BLOCK_V, FIX_RNE, NUM_STAGES,
                         LANE_SUMS, SUB_ROWS, FAST_MATH)  # fmt: skip


# -- dH rows and the target column ----------------------------------------------------------


@triton.jit
def _dhidden_row_block(i, h0, dh_ptr, stride_dh, part_ptr, stride_part, out_rows_ptr, coef_ptr,
                       labels_ptr, w_ptr, stride_wv, stride_wk, hidden_size,
                       HAS_PART: tl.constexpr, ADD_TARGET: tl.constexpr,
                       ACCUMULATE: tl.constexpr, BLOCK_H: tl.constexpr,
                       FIX_RNE: tl.constexpr):  # fmt: skip
    i64 = tl.cast(i, tl.int64)
    hs = tl.arange(0, BLOCK_H)
    mask = hs < hidden_size - h0
    acc = tl.zeros([BLOCK_H], tl.float32)
    if HAS_PART:
        part = tl.load(part_ptr + i64 * stride_part + h0 + hs, mask=mask, other=0.0)
        acc += part.to(tl.float32)
    if ADD_TARGET:
        coef = tl.load(coef_ptr + i64)
        y = tl.load(labels_ptr + i64).to(tl.int64)
        w = tl.load(w_ptr + y * stride_wv + (h0 + hs) * stride_wk, mask=mask, other=0.0)
        acc += coef * w.to(tl.float32)
    dst = dh_ptr + tl.load(out_rows_ptr + i64).to(tl.int64) * stride_dh + h0 + hs
    if ACCUMULATE:
        acc += tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, _cast(acc, dh_ptr.dtype.element_ty, FIX_RNE), mask=mask)


@triton.jit
def dhidden_rows_store_kernel(
    dh_ptr,
    stride_dh,
    part_ptr,
    stride_part,
    out_rows_ptr,
    coef_ptr,
    labels_ptr,
    w_ptr,
    stride_wv,
    stride_wk,
    n_rows,
    hidden_size,
    HAS_PART: tl.constexpr,
    ADD_TARGET: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FIX_RNE: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    """``dH[out_rows[i]] (+)= part[i] + coef[i] * W[labels[i]]`` in float32, rounded once.

    Grid ``(r, cdiv(H, BLOCK_H))``, or ``(P,)`` programs looping over rows and ``H`` blocks
    when ``PERSISTENT``. ``part`` is ``[r, H]`` (any float dtype; the dense ``dz @ W`` of a
    chunk, or a float32 partial sum); ``dH`` is ``[N, H]``.
    """
    if PERSISTENT:
        for i in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            for h0 in range(0, hidden_size, BLOCK_H):
                _dhidden_row_block(i, h0, dh_ptr, stride_dh, part_ptr, stride_part,
                                   out_rows_ptr, coef_ptr, labels_ptr, w_ptr, stride_wv,
                                   stride_wk, hidden_size, HAS_PART, ADD_TARGET, ACCUMULATE,
                                   BLOCK_H, FIX_RNE)  # fmt: skip
    else:
        _dhidden_row_block(tl.program_id(0), tl.program_id(1) * BLOCK_H, dh_ptr, stride_dh,
                           part_ptr, stride_part, out_rows_ptr, coef_ptr, labels_ptr, w_ptr,
                           stride_wv, stride_wk, hidden_size, HAS_PART, ADD_TARGET, ACCUMULATE,
                           BLOCK_H, FIX_RNE)  # fmt: skip


@triton.jit
def _add_target_rows(acc, coef_sum, k, order_ptr, coef_ptr, h_ptr, row_off_ptr, stride_hk, hs,
                     h0, mask, NEED_W: tl.constexpr):  # fmt: skip
    """``acc += coef_r * h_r[h0 : h0 + BLOCK_H]`` and ``coef_sum += coef_r`` for the row at
    sorted position ``k``."""
    r = tl.load(order_ptr + k)
    coef = tl.load(coef_ptr + r)
    if NEED_W:
        h = tl.load(h_ptr + tl.load(row_off_ptr + r) + (h0 + hs) * stride_hk, mask=mask, other=0.0)
        acc += coef * h.to(tl.float32)
    return acc, coef_sum + coef


@triton.jit
def _store_target_row(acc, coef_sum, y64, dw_ptr, stride_dwv, db_ptr, v_lo, h0, hs, mask,
                      NEED_W: tl.constexpr, NEED_B: tl.constexpr, FIX_RNE: tl.constexpr):  # fmt: skip
    """``dW[y - v_lo, h0 : h0 + BLOCK_H] += acc`` (one rounding) and, for the first ``H``
    block, ``db[y] += coef_sum``."""
    if NEED_W:
        dst = dw_ptr + (y64 - v_lo) * stride_dwv + h0 + hs
        acc += tl.load(dst, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst, _cast(acc, dw_ptr.dtype.element_ty, FIX_RNE), mask=mask)
    if NEED_B:
        if h0 == 0:
            tl.store(db_ptr + y64, tl.load(db_ptr + y64) + coef_sum)


@triton.jit
def target_dweight_kernel(
    dw_ptr,
    stride_dwv,
    db_ptr,
    sorted_labels_ptr,
    order_ptr,
    coef_ptr,
    h_ptr,
    row_off_ptr,
    stride_hk,
    n_rows,
    hidden_size,
    v_lo,
    v_hi,
    NEED_W: tl.constexpr,
    NEED_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FIX_RNE: tl.constexpr,
):
    """Target column's share of dW and db for labels in ``[v_lo, v_hi)`` (CUDA):
    ``dW[y - v_lo] += sum_{r: y_r = y} coef_r * h_r`` and ``db[y] += sum coef_r``.

    Grid ``(M, cdiv(H, BLOCK_H))`` over counted rows sorted by label; the first row of each
    run of equal labels sums the run in float32 and adds it to ``dW`` once (deterministic,
    one rounding), finding the run's end itself (no host sync). ``order[j]`` maps sorted
    position ``j`` to the row's index in ``coef`` and ``row_off`` (element offsets of the rows
    in ``hidden``). ``dW`` may be a float32 accumulator of the rows ``[v_lo, v_hi)`` only.
    """
    i = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    hs = tl.arange(0, BLOCK_H)
    mask = hs < hidden_size - h0
    y = tl.load(sorted_labels_ptr + i)
    prev = tl.load(sorted_labels_ptr + i - 1, mask=i > 0, other=-1)
    if (prev != y) & (y >= v_lo) & (y < v_hi):
        acc = tl.zeros([BLOCK_H], tl.float32)
        coef_sum = 0.0
        j = i
        y_j = y
        while y_j == y:
            acc, coef_sum = _add_target_rows(acc, coef_sum, j, order_ptr, coef_ptr, h_ptr,
                                             row_off_ptr, stride_hk, hs, h0, mask, NEED_W)  # fmt: skip
            j += 1
            y_j = tl.load(sorted_labels_ptr + j, mask=j < n_rows, other=-1)
        _store_target_row(acc, coef_sum, y.to(tl.int64), dw_ptr, stride_dwv, db_ptr, v_lo, h0,
                          hs, mask, NEED_W, NEED_B, FIX_RNE)  # fmt: skip


@triton.jit
def target_dweight_runs_kernel(
    dw_ptr,
    stride_dwv,
    db_ptr,
    run_labels_ptr,
    run_starts_ptr,
    order_ptr,
    coef_ptr,
    h_ptr,
    row_off_ptr,
    stride_hk,
    n_runs,
    hidden_size,
    v_lo,
    v_hi,
    NEED_W: tl.constexpr,
    NEED_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FIX_RNE: tl.constexpr,
):
    """:func:`target_dweight_kernel` for triton-ascend, whose grid axes stop at 65535 (one
    program per counted row does not fit) and whose programs beyond the core count run in
    further rounds: the runs of equal labels are found on the host (run ``k``, label
    ``run_labels[k]``, covers sorted positions ``[run_starts[k], run_starts[k + 1])``) and
    ``P`` programs, ``P`` <= vector cores, each own whole runs, so every ``dW`` row is written
    by one program, once per ``H`` block, with one rounding (deterministic, no atomics).
    """
    hs = tl.arange(0, BLOCK_H)
    for k in range(tl.program_id(0), n_runs, tl.num_programs(0)):
        k64 = tl.cast(k, tl.int64)
        y = tl.load(run_labels_ptr + k64).to(tl.int64)
        if (y >= v_lo) & (y < v_hi):
            start = tl.load(run_starts_ptr + k64)
            end = tl.load(run_starts_ptr + k64 + 1)
            for h0 in range(0, hidden_size, BLOCK_H):
                mask = hs < hidden_size - h0
                acc = tl.zeros([BLOCK_H], tl.float32)
                coef_sum = 0.0
                for j in range(start, end):
                    acc, coef_sum = _add_target_rows(acc, coef_sum, j, order_ptr, coef_ptr,
                                                     h_ptr, row_off_ptr, stride_hk, hs, h0,
                                                     mask, NEED_W)  # fmt: skip
                _store_target_row(acc, coef_sum, y, dw_ptr, stride_dwv, db_ptr, v_lo, h0, hs,
                                  mask, NEED_W, NEED_B, FIX_RNE)  # fmt: skip


# -- zero-logits path -----------------------------------------------------------------------


@triton.jit
def _logits_tile(h_ptr, row_off, row_mask, stride_hk, w_ptr, v0, col_mask, stride_wv,
                 stride_wk, hidden_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):  # fmt: skip
    """``[BLOCK_M, BLOCK_N]`` float32 tile of ``hidden[rows] @ W[v0 : v0 + BLOCK_N].T`` (K loop
    over H; pointers rebuilt from the loop index, never carried across iterations)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ks = tl.arange(0, BLOCK_K)
    local = tl.arange(0, BLOCK_N)
    w_tile = w_ptr + tl.cast(v0, tl.int64) * stride_wv
    for k0 in range(0, hidden_size, BLOCK_K):
        a_ptrs = h_ptr + row_off[:, None] + (k0 + ks)[None, :] * stride_hk
        b_ptrs = w_tile + local[:, None] * stride_wv + (k0 + ks)[None, :] * stride_wk
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_mask[:, None], other=0.0)
        else:
            k_mask = ks < hidden_size - k0
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _dot(a, tl.trans(b), acc, DOT_PRECISION, UPCAST)
    return acc


@triton.jit
def _row_block(r0, row_off_ptr, labels_ptr, n_rows, BLOCK_M: tl.constexpr,
               ROW_ALIGN: tl.constexpr):  # fmt: skip
    """Rows ``[r0, r0 + BLOCK_M)``: their mask, element offsets in ``hidden`` and labels."""
    rows = r0 + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    row_off = tl.load(row_off_ptr + rows, mask=row_mask, other=0)
    if ROW_ALIGN > 1:  # lets the gathered hidden-row loads be vectorised and pipelined
        row_off = tl.multiple_of(row_off, ROW_ALIGN)
    y = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
    return rows, row_mask, row_off, y


@triton.jit
def _lse_forward_task(r0, split, h_ptr, row_off_ptr, stride_hk, w_ptr, stride_wv, stride_wk,
                      b_ptr, labels_ptr, part_ptr, n_rows, n_splits, vocab, hidden_size,
                      vocab_per_split, softcap, HAS_BIAS: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                      ROW_ALIGN: tl.constexpr):  # fmt: skip
    rows, row_mask, row_off, y = _row_block(r0, row_off_ptr, labels_ptr, n_rows, BLOCK_M,
                                            ROW_ALIGN)  # fmt: skip
    m = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    z_y = tl.zeros([BLOCK_M], tl.float32)
    z_sum = tl.zeros([BLOCK_M], tl.float32)
    local = tl.arange(0, BLOCK_N)
    v_begin = split * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, vocab)
    for v0 in range(v_begin, v_end, BLOCK_N):
        col_mask = local < v_end - v0
        z = _logits_tile(h_ptr, row_off, row_mask, stride_hk, w_ptr, v0, col_mask, stride_wv,
                         stride_wk, hidden_size, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                         DOT_PRECISION, UPCAST)  # fmt: skip
        if HAS_BIAS:
            bias = tl.load(b_ptr + tl.cast(v0, tl.int64) + local, mask=col_mask, other=0.0)
            z += bias.to(tl.float32)[None, :]
        if HAS_SOFTCAP:
            z = _softcap(z, softcap, 1.0 / softcap)
        if SMOOTHING:
            z_sum += tl.sum(tl.where(col_mask[None, :], z, 0.0), axis=1)
        z_y += tl.sum(tl.where(local[None, :] == (y - v0)[:, None], z, 0.0), axis=1)
        z = tl.where(col_mask[None, :], z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
    out = part_ptr + tl.cast(split, tl.int64) * n_rows + rows
    field = tl.cast(n_splits, tl.int64) * n_rows
    tl.store(out, m, mask=row_mask)
    tl.store(out + field, s, mask=row_mask)
    tl.store(out + 2 * field, z_y, mask=row_mask)
    tl.store(out + 3 * field, z_sum, mask=row_mask)


@triton.jit
def lse_forward_kernel(
    h_ptr,
    row_off_ptr,
    stride_hk,
    w_ptr,
    stride_wv,
    stride_wk,
    b_ptr,
    labels_ptr,
    part_ptr,
    n_rows,
    vocab,
    hidden_size,
    n_splits,
    vocab_per_split,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    """Zero-logits forward: partial statistics of ``BLOCK_M`` counted rows over one split of
    the vocabulary, from logit tiles that stay on chip.

    Grid ``(cdiv(M, BLOCK_M), n_splits)``, or ``(P,)`` programs looping over the tasks
    ``t = row_block * n_splits + split`` when ``PERSISTENT``. Writes ``part[f, split, row]``
    (float32) for the fields f = 0 running max, 1 sum of exp relative to it, 2 the
    (softcapped) target logit if it lies in this split else 0, 3 the sum of (softcapped)
    logits in the split.
    """
    if PERSISTENT:
        n_tasks = tl.cdiv(n_rows, BLOCK_M) * n_splits
        for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
            _lse_forward_task((task // n_splits) * BLOCK_M, task % n_splits, h_ptr, row_off_ptr,
                              stride_hk, w_ptr, stride_wv, stride_wk, b_ptr, labels_ptr,
                              part_ptr, n_rows, n_splits, vocab, hidden_size, vocab_per_split,
                              softcap, HAS_BIAS, HAS_SOFTCAP, SMOOTHING, BLOCK_M, BLOCK_N,
                              BLOCK_K, EVEN_K, DOT_PRECISION, UPCAST, ROW_ALIGN)  # fmt: skip
    else:
        _lse_forward_task(tl.program_id(0) * BLOCK_M, tl.program_id(1), h_ptr, row_off_ptr,
                          stride_hk, w_ptr, stride_wv, stride_wk, b_ptr, labels_ptr, part_ptr,
                          n_rows, n_splits, vocab, hidden_size, vocab_per_split, softcap,
                          HAS_BIAS, HAS_SOFTCAP, SMOOTHING, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                          DOT_PRECISION, UPCAST, ROW_ALIGN)  # fmt: skip


@triton.jit
def _backward_task(r0, c0, h_ptr, row_off_ptr, stride_hk, w_ptr, stride_wv, stride_wk, b_ptr,
                   labels_ptr, lse_ptr, scale_ptr, scale_value, dh_acc_ptr, dw_acc_ptr, db_ptr,
                   n_rows, v_start, n_cols, vocab, hidden_size, softcap, label_smoothing,
                   z_loss, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, SCALE_MODE: tl.constexpr,
                   NEED_H: tl.constexpr, NEED_W: tl.constexpr, NEED_B: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_H: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, FIX_RNE: tl.constexpr, ROW_ALIGN: tl.constexpr,
                   FRESH_OPERANDS: tl.constexpr, ATOMIC_SEM: tl.constexpr):  # fmt: skip
    rows, row_mask, row_off, y = _row_block(r0, row_off_ptr, labels_ptr, n_rows, BLOCK_M,
                                            ROW_ALIGN)  # fmt: skip
    local = tl.arange(0, BLOCK_N)
    col_mask = local < n_cols - c0
    v0 = v_start + c0
    z = _logits_tile(h_ptr, row_off, row_mask, stride_hk, w_ptr, v0, col_mask, stride_wv,
                     stride_wk, hidden_size, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION,
                     UPCAST)  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(b_ptr + tl.cast(v0, tl.int64) + local, mask=col_mask, other=0.0)
        z += bias.to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        t, slope = _tanh_and_slope(z * (1.0 / softcap))
        z = softcap * t
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    if SCALE_MODE == 0:
        scale = tl.zeros([BLOCK_M], tl.float32) + scale_value
    elif SCALE_MODE == 1:
        scale = tl.zeros([BLOCK_M], tl.float32) + tl.load(scale_ptr).to(tl.float32)
    else:
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    p_scale = scale
    if Z_LOSS:
        p_scale = scale * (1.0 + 2.0 * z_loss * lse)
    g = tl.exp(z - lse[:, None]) * p_scale[:, None]
    if SMOOTHING:
        g -= (scale * (label_smoothing / vocab))[:, None]
    if HAS_SOFTCAP:
        g = g * slope
    keep = row_mask[:, None] & col_mask[None, :] & (local[None, :] != (y - v0)[:, None])
    g = tl.where(keep, g, 0.0)
    if NEED_B:
        _atomic_add(db_ptr + tl.cast(v0, tl.int64) + local, tl.sum(g, axis=0), col_mask,
                    ATOMIC_SEM)  # fmt: skip
    g_in = _cast(g, w_ptr.dtype.element_ty, FIX_RNE)  # rounded as the matmul operands are
    hs = tl.arange(0, BLOCK_H)
    dh_rows = dh_acc_ptr + tl.cast(r0, tl.int64) * hidden_size
    dw_rows = dw_acc_ptr + tl.cast(c0, tl.int64) * hidden_size
    w_tile = w_ptr + tl.cast(v0, tl.int64) * stride_wv
    for h0 in range(0, hidden_size, BLOCK_H):
        h_mask = hs < hidden_size - h0
        if NEED_H:
            w = tl.load(
                w_tile + local[:, None] * stride_wv + (h0 + hs)[None, :] * stride_wk,
                mask=col_mask[:, None] & h_mask[None, :],
                other=0.0,
            )
            dh = _dot(_operand(g_in, FRESH_OPERANDS), w, tl.zeros([BLOCK_M, BLOCK_H], tl.float32),
                      DOT_PRECISION, UPCAST)  # fmt: skip
            _atomic_add(dh_rows + tl.arange(0, BLOCK_M)[:, None] * hidden_size + (h0 + hs)[None, :],
                        dh, row_mask[:, None] & h_mask[None, :], ATOMIC_SEM)  # fmt: skip
        if NEED_W:
            h = tl.load(
                h_ptr + row_off[:, None] + (h0 + hs)[None, :] * stride_hk,
                mask=row_mask[:, None] & h_mask[None, :],
                other=0.0,
            )
            dw = _dot(tl.trans(_operand(g_in, FRESH_OPERANDS)), h,
                      tl.zeros([BLOCK_N, BLOCK_H], tl.float32), DOT_PRECISION, UPCAST)  # fmt: skip
            _atomic_add(dw_rows + local[:, None] * hidden_size + (h0 + hs)[None, :], dw,
                        col_mask[:, None] & h_mask[None, :], ATOMIC_SEM)  # fmt: skip


@triton.jit
def dhidden_dweight_backward_kernel(
    h_ptr,
    row_off_ptr,
    stride_hk,
    w_ptr,
    stride_wv,
    stride_wk,
    b_ptr,
    labels_ptr,
    lse_ptr,
    scale_ptr,
    scale_value,
    dh_acc_ptr,
    dw_acc_ptr,
    db_ptr,
    n_rows,
    v_start,
    n_cols,
    vocab,
    hidden_size,
    softcap,
    label_smoothing,
    z_loss,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
    Z_LOSS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    NEED_H: tl.constexpr,
    NEED_W: tl.constexpr,
    NEED_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    FIX_RNE: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    FRESH_OPERANDS: tl.constexpr,
    ATOMIC_SEM: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    """Zero-logits backward for a group of ``n_rows`` counted rows and the vocabulary columns
    ``[v_start, v_start + n_cols)``: recompute each logit tile on chip, form ``scale * dL/dz``
    without the target column and add its products into float32 accumulators with atomics:

        dh_acc[r, :]           += dz[r, tile] @ W[tile, :]      (``[n_rows, H]``)
        dw_acc[v - v_start, :] += dz[:, v]^T @ hidden[rows, :]  (``[n_cols, H]``)
        db[v]                  += sum_r dz[r, v]                 (``[V]``)

    Grid ``(cdiv(n_rows, BLOCK_M), cdiv(n_cols, BLOCK_N))``, or ``(P,)`` programs looping over
    the tasks when ``PERSISTENT`` (task ``t`` is row block ``t % row_blocks`` of vocabulary
    tile ``t // row_blocks``, so programs running together share a weight tile). The target
    column is added afterwards (module docstring).
    """
    if PERSISTENT:
        row_blocks = tl.cdiv(n_rows, BLOCK_M)
        n_tasks = row_blocks * tl.cdiv(n_cols, BLOCK_N)
        for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
            _backward_task((task % row_blocks) * BLOCK_M, (task // row_blocks) * BLOCK_N, h_ptr,
                           row_off_ptr, stride_hk, w_ptr, stride_wv, stride_wk, b_ptr,
                           labels_ptr, lse_ptr, scale_ptr, scale_value, dh_acc_ptr, dw_acc_ptr,
                           db_ptr, n_rows, v_start, n_cols, vocab, hidden_size, softcap,
                           label_smoothing, z_loss, HAS_BIAS, HAS_SOFTCAP, SMOOTHING, Z_LOSS,
                           SCALE_MODE, NEED_H, NEED_W, NEED_B, BLOCK_M, BLOCK_N, BLOCK_K,
                           BLOCK_H, EVEN_K, DOT_PRECISION, UPCAST, FIX_RNE, ROW_ALIGN,
                           FRESH_OPERANDS, ATOMIC_SEM)  # fmt: skip
    else:
        _backward_task(tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N, h_ptr,
                       row_off_ptr, stride_hk, w_ptr, stride_wv, stride_wk, b_ptr, labels_ptr,
                       lse_ptr, scale_ptr, scale_value, dh_acc_ptr, dw_acc_ptr, db_ptr, n_rows,
                       v_start, n_cols, vocab, hidden_size, softcap, label_smoothing, z_loss,
                       HAS_BIAS, HAS_SOFTCAP, SMOOTHING, Z_LOSS, SCALE_MODE, NEED_H, NEED_W,
                       NEED_B, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_H, EVEN_K, DOT_PRECISION,
                       UPCAST, FIX_RNE, ROW_ALIGN, FRESH_OPERANDS, ATOMIC_SEM)  # fmt: skip


# -- zero-logits path, in-place backward: one vocabulary chunk of logits in spare storage ---


@triton.jit
def _grad_tile(x, lse, p_scale, scale, softcap, label_smoothing, vocab,
               HAS_SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """``scale_r * dL/dz`` of a float32 tile of (bias-added) logits ``x [rows, cols]``, target
    column included: ``exp(s - LSE_r) * p_scale_r - scale_r * eps / V`` times ``ds/dz`` with
    a softcap; ``lse``, ``p_scale``, ``scale`` ``[rows]``."""
    if HAS_SOFTCAP:
        t, slope = _tanh_and_slope(x * (1.0 / softcap), FAST)
        x = softcap * t
    g = _exp(x - lse[:, None], FAST) * p_scale[:, None]
    if SMOOTHING:
        g -= (scale * (label_smoothing / vocab))[:, None]
    if HAS_SOFTCAP:
        g = g * slope
    return g


@triton.jit
def logits_grad_cols_kernel(z_ptr, stride_z, g_ptr, stride_g, b_ptr, labels_ptr, lse_ptr,
                            p_scale_ptr, scale_ptr, n_rows, n_cols, v0, vocab, softcap,
                            label_smoothing, HAS_BIAS: tl.constexpr,
                            HAS_SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                            FIX_RNE: tl.constexpr, FAST_MATH: tl.constexpr):  # fmt: skip
    """From float32 logits ``z[r, c]`` (row ``r``, vocabulary column ``v0 + c``, no bias),
    the input-dtype gradient ``g[r, c] = scale_r * dL/dz`` without the target column:

        g = exp(s - LSE_r) * p_scale_r - scale_r * eps / V     (times ds/dz with softcap)

    with ``s`` the (bias-added, softcapped) logit and ``p_scale_r = scale_r * (1 + 2 * z_loss *
    LSE_r)`` formed by the caller; 0 in each row's target column and in every row whose
    label is negative (not counted).

    ``g`` may overlay ``z``: row ``r`` of ``g`` may start at the first byte of row ``r`` of
    ``z`` (``stride_g = 2 * stride_z`` in 16-bit elements). Each program owns ``BLOCK_R``
    whole rows and walks them left to right; a block's stores land on bytes of this or
    earlier blocks of its own rows, which every thread has read before the barrier. Grid
    ``(cdiv(n_rows, BLOCK_R),)``; no atomics. ``labels`` int64; ``lse``, ``p_scale``,
    ``scale`` float32 ``[n_rows]``.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    y = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    p_scale = tl.load(p_scale_ptr + rows, mask=row_mask, other=0.0)
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    counted = y >= 0
    rows64 = tl.cast(rows, tl.int64)
    local = tl.arange(0, BLOCK_C)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = c0 + local
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(z_ptr + rows64[:, None] * stride_z + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + tl.cast(v0, tl.int64) + cols, mask=cols < n_cols, other=0.0)
            x += bias.to(tl.float32)[None, :]
        g = _grad_tile(x, lse, p_scale, scale, softcap, label_smoothing, vocab, HAS_SOFTCAP,
                       SMOOTHING, FAST_MATH)  # fmt: skip
        keep = counted[:, None] & (cols[None, :] != (y - v0)[:, None])
        g = _cast(tl.where(keep, g, 0.0), g_ptr.dtype.element_ty, FIX_RNE)
        tl.debug_barrier()  # every thread's loads of this block done before any store
        tl.store(g_ptr + rows64[:, None] * stride_g + cols[None, :], g, mask=mask)


@triton.jit
def lse_cols_kernel(z_ptr, stride_z, b_ptr, labels_ptr, state_ptr, n_rows, n_cols, v0, softcap,
                    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                    FAST_MATH: tl.constexpr):  # fmt: skip
    """Merge one vocabulary chunk of float32 logits ``z[r, c]`` (row ``r``, column ``v0 + c``,
    no bias) into each row's running log-sum-exp state ``state [4, n_rows]`` (float32): max
    ``m``, sum of ``exp(s - m)``, target logit (0 until the chunk holding the label), sum of
    logits (label smoothing only); ``s`` is the bias-added, softcapped logit. Rows start at
    ``m = _NEG_BIG`` (finite, so that ``exp(m_old - m_new)`` never sees inf - inf when a whole
    chunk is -inf), the others 0. Each program owns ``BLOCK_R`` whole rows; no atomics. Grid
    ``(cdiv(n_rows, BLOCK_R),)``; ``labels`` int64 (< 0: never a target). Source: the online
    softmax normaliser of Milakov & Gimelshein (2018)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    y = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
    m = tl.load(state_ptr + rows, mask=row_mask, other=0.0)
    s = tl.load(state_ptr + n_rows + rows, mask=row_mask, other=0.0)
    z_t = tl.load(state_ptr + 2 * n_rows + rows, mask=row_mask, other=0.0)
    z_s = tl.load(state_ptr + 3 * n_rows + rows, mask=row_mask, other=0.0)
    rows64 = tl.cast(rows, tl.int64)
    target = y - v0
    local = tl.arange(0, BLOCK_C)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = c0 + local
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(z_ptr + rows64[:, None] * stride_z + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + tl.cast(v0, tl.int64) + cols, mask=col_mask, other=0.0)
            x += bias.to(tl.float32)[None, :]
        if HAS_SOFTCAP:
            x = _softcap(x, softcap, 1.0 / softcap, FAST_MATH)
        x = tl.where(col_mask[None, :], x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(_exp(x - m_new[:, None], FAST_MATH), axis=1)
        m = m_new
        hit = (cols[None, :] == target[:, None]) & col_mask[None, :]
        z_t += tl.sum(tl.where(hit, x, 0.0), axis=1)
        if SMOOTHING:
            z_s += tl.sum(tl.where(col_mask[None, :], x, 0.0), axis=1)
    tl.store(state_ptr + rows, m, mask=row_mask)
    tl.store(state_ptr + n_rows + rows, s, mask=row_mask)
    tl.store(state_ptr + 2 * n_rows + rows, z_t, mask=row_mask)
    tl.store(state_ptr + 3 * n_rows + rows, z_s, mask=row_mask)


# -- zero-logits path, forward on Hopper: a TMA-descriptor GEMM with the LSE in its epilogue --


@triton.jit
def _grouped_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """``(row block, column block)`` of tile number ``tile``, in groups of ``GROUP_M`` row
    blocks that sweep the column blocks together (their weight tiles are shared in L2)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    local = tile % per_group
    return first_m + local % size_m, local // size_m


@triton.jit
def _tma_logits_tile(h_desc, w_desc, off_m, w_row, k_tiles, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """float32 ``h[off_m : off_m + BLOCK_M] @ W[w_row : w_row + BLOCK_N].T`` from TMA
    descriptors (rows beyond either tensor read as 0)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kk in range(k_tiles):
        a = h_desc.load([off_m, kk * BLOCK_K])
        b = w_desc.load([w_row, kk * BLOCK_K])
        if UPCAST:  # the interpreter multiplies raw 16-bit patterns (module docstring)
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc,
                         input_precision="ieee")  # fmt: skip
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _tma_logits_epilogue(acc, off_n, n_cols, v0, b_ptr, softcap, HAS_BIAS: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
                         FAST_MATH: tl.constexpr):  # fmt: skip
    """``(x, cols, col_ok)`` of the TMA forwards' float32 logits tile ``acc`` of the columns
    ``off_n ...`` (relative to ``v0``): ``x`` bias-added and softcapped, ``-inf`` beyond
    ``n_cols``."""
    cols = off_n + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    x = acc
    if HAS_BIAS:
        bias = tl.load(b_ptr + tl.cast(v0, tl.int64) + cols, mask=col_ok, other=0.0)
        x += bias.to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        x = _softcap(x, softcap, 1.0 / softcap, FAST_MATH)
    return tl.where(col_ok[None, :], x, float("-inf")), cols, col_ok


@triton.jit
def lse_tma_kernel(h_desc, w_desc, b_ptr, labels_ptr, part_ptr, n_rows, n_cols, v0, hsize,
                   softcap, n_programs, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   SMOOTHING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   WARP_SPECIALIZE: tl.constexpr, FAST_MATH: tl.constexpr,
                   UPCAST: tl.constexpr):  # fmt: skip
    """Partial LSE statistics of the vocabulary columns ``[v0, v0 + n_cols)`` for every row of
    ``h [n_rows, H]``: per column block ``t`` of ``BLOCK_N`` columns, ``part[k, t, r]``
    (float32 ``[4, cdiv(n_cols, BLOCK_N), n_rows]``) is, for ``k`` = 0..3, the block's max of
    ``s`` (at least ``_NEG_BIG``), the sum of ``exp(s - max)``, the target logit (0 unless the
    label lies in the block) and the sum of logits (written only with ``SMOOTHING``); ``s`` is
    the bias-added, softcapped logit. The logits tile never leaves registers.

    ``h_desc`` ``[n_rows, H]`` and ``w_desc`` ``[V, H]`` are TMA tensor descriptors (16-bit,
    blocks ``[BLOCK_M, BLOCK_K]`` and ``[BLOCK_N, BLOCK_K]``; out-of-range rows and columns
    read as 0 and are masked here). A persistent grid of ``n_programs`` programs walks the tiles
    in ``GROUP_M`` row-block groups (:func:`_grouped_tile`). ``labels`` int64 ``[n_rows]``
    (< 0: never a target). Source: the online softmax normaliser of Milakov & Gimelshein
    (2018); the tiled GEMM with the LSE in its epilogue of Wijmans et al. (2024)."""
    num_m = tl.cdiv(n_rows, BLOCK_M)
    num_n = tl.cdiv(n_cols, BLOCK_N)
    k_tiles = tl.cdiv(hsize, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, n_programs, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):  # fmt: skip
        pm, pn = _grouped_tile(tile, num_m, num_n, GROUP_M)
        off_m = pm * BLOCK_M
        off_n = pn * BLOCK_N
        acc = _tma_logits_tile(h_desc, w_desc, off_m, v0 + off_n, k_tiles, BLOCK_M, BLOCK_N,
                               BLOCK_K, UPCAST)  # fmt: skip
        x, cols, col_ok = _tma_logits_epilogue(acc, off_n, n_cols, v0, b_ptr, softcap, HAS_BIAS,
                                               HAS_SOFTCAP, BLOCK_N, FAST_MATH)  # fmt: skip
        m = tl.maximum(tl.max(x, axis=1), _NEG_BIG)  # finite: no inf - inf on a -inf block
        s = tl.sum(_exp(x - m[:, None], FAST_MATH), axis=1)
        rows = off_m + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        y = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        hit = ((cols + v0)[None, :] == y[:, None]) & col_ok[None, :]
        z_t = tl.sum(tl.where(hit, x, 0.0), axis=1)
        out = part_ptr + tl.cast(pn, tl.int64) * n_rows + rows
        plane = tl.cast(num_n, tl.int64) * n_rows
        tl.store(out, m, mask=row_ok)
        tl.store(out + plane, s, mask=row_ok)
        tl.store(out + 2 * plane, z_t, mask=row_ok)
        if SMOOTHING:
            tl.store(out + 3 * plane, tl.sum(tl.where(col_ok[None, :], x, 0.0), axis=1),
                     mask=row_ok)  # fmt: skip


@triton.jit
def lse_tma_runs_kernel(h_desc, w_desc, b_ptr, labels_ptr, part_ptr, n_rows, n_cols, v0, hsize,
                        softcap, n_programs, run_tiles, HAS_BIAS: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        WARP_SPECIALIZE: tl.constexpr, FAST_MATH: tl.constexpr,
                        UPCAST: tl.constexpr):  # fmt: skip
    """:func:`lse_tma_kernel`'s statistics per *run* of ``run_tiles`` consecutive column blocks
    instead of per block: run ``r`` is row block ``r % num_m`` over the column blocks
    ``[(r // num_m) * run_tiles, ... + run_tiles)``, its statistics kept in registers across
    the run (online max and sum, Milakov & Gimelshein 2018) and stored once, as
    ``part[k, r // num_m, rows]`` (float32 ``[4, cdiv(cdiv(n_cols, BLOCK_N), run_tiles),
    n_rows]``). Program ``p`` of the persistent grid takes runs ``p, p + n_programs, ...``: row
    blocks side by side, so that the programs running at once sweep the same weight tiles (the
    loop over a run's blocks is the pipelined, warp-specialised one). Column blocks beyond
    ``n_cols`` (in the last run) count as ``-inf`` logits; TMA reads rows beyond ``W`` as 0."""
    num_m = tl.cdiv(n_rows, BLOCK_M)
    n_segs = tl.cdiv(tl.cdiv(n_cols, BLOCK_N), run_tiles)
    k_tiles = tl.cdiv(hsize, BLOCK_K)
    plane = tl.cast(n_segs, tl.int64) * n_rows
    for run in range(tl.program_id(0), num_m * n_segs, n_programs):
        pm = run % num_m
        seg = run // num_m
        off_m = pm * BLOCK_M
        rows = off_m + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        y = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        m = tl.full((BLOCK_M,), _NEG_BIG, tl.float32)
        s = tl.zeros((BLOCK_M,), tl.float32)
        z_t = tl.zeros((BLOCK_M,), tl.float32)
        z_s = tl.zeros((BLOCK_M,), tl.float32)
        for j in tl.range(0, run_tiles, flatten=True, warp_specialize=WARP_SPECIALIZE):
            off_n = (seg * run_tiles + j) * BLOCK_N
            acc = _tma_logits_tile(h_desc, w_desc, off_m, v0 + off_n, k_tiles, BLOCK_M,
                                   BLOCK_N, BLOCK_K, UPCAST)  # fmt: skip
            x, cols, col_ok = _tma_logits_epilogue(acc, off_n, n_cols, v0, b_ptr, softcap,
                                                   HAS_BIAS, HAS_SOFTCAP, BLOCK_N,
                                                   FAST_MATH)  # fmt: skip
            m_new = tl.maximum(m, tl.max(x, axis=1))
            s = s * _exp(m - m_new, FAST_MATH) + tl.sum(_exp(x - m_new[:, None], FAST_MATH),
                                                        axis=1)  # fmt: skip
            m = m_new
            hit = ((cols + v0)[None, :] == y[:, None]) & col_ok[None, :]
            z_t += tl.sum(tl.where(hit, x, 0.0), axis=1)
            if SMOOTHING:
                z_s += tl.sum(tl.where(col_ok[None, :], x, 0.0), axis=1)
        out = part_ptr + tl.cast(seg, tl.int64) * n_rows + rows
        tl.store(out, m, mask=row_ok)
        tl.store(out + plane, s, mask=row_ok)
        tl.store(out + 2 * plane, z_t, mask=row_ok)
        if SMOOTHING:
            tl.store(out + 3 * plane, z_s, mask=row_ok)


@triton.jit
def lse_merge_kernel(part_ptr, state_ptr, n_rows, n_blocks, SMOOTHING: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """Merge the ``n_blocks`` column blocks of :func:`lse_tma_kernel`'s ``part`` (float32
    ``[4, n_blocks, n_rows]``) into each row's running state ``state [4, n_rows]`` (as
    :func:`lse_cols_kernel` keeps it: max, sum of exp relative to it, target logit, sum of
    logits). Each program owns ``BLOCK_R`` rows; no atomics. Grid ``(cdiv(n_rows, BLOCK_R),)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    m = tl.load(state_ptr + rows, mask=row_ok, other=0.0)
    s = tl.load(state_ptr + n_rows + rows, mask=row_ok, other=0.0)
    z_t = tl.load(state_ptr + 2 * n_rows + rows, mask=row_ok, other=0.0)
    z_s = tl.load(state_ptr + 3 * n_rows + rows, mask=row_ok, other=0.0)
    plane = tl.cast(n_blocks, tl.int64) * n_rows
    for t0 in range(0, n_blocks, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ok = (t < n_blocks)[:, None] & row_ok[None, :]
        at = part_ptr + tl.cast(t, tl.int64)[:, None] * n_rows + rows[None, :]
        pm = tl.load(at, mask=ok, other=_NEG_BIG)
        ps = tl.load(at + plane, mask=ok, other=0.0)
        m_new = tl.maximum(m, tl.max(pm, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(ps * tl.exp(pm - m_new[None, :]), axis=0)
        m = m_new
        z_t += tl.sum(tl.load(at + 2 * plane, mask=ok, other=0.0), axis=0)
        if SMOOTHING:
            z_s += tl.sum(tl.load(at + 3 * plane, mask=ok, other=0.0), axis=0)
    tl.store(state_ptr + rows, m, mask=row_ok)
    tl.store(state_ptr + n_rows + rows, s, mask=row_ok)
    tl.store(state_ptr + 2 * n_rows + rows, z_t, mask=row_ok)
    tl.store(state_ptr + 3 * n_rows + rows, z_s, mask=row_ok)


# -- zero-logits path, in-place backward on Hopper: the chunk's gradient in the GEMM epilogue --


@triton.jit
def grad_tma_kernel(h_desc, w_desc, g_ptr, stride_g, b_ptr, labels_ptr, lse_ptr, p_scale_ptr,
                    scale_ptr, n_rows, n_cols, v0, vocab, hsize, softcap, label_smoothing,
                    n_programs, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    SMOOTHING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    WARP_SPECIALIZE: tl.constexpr, FAST_MATH: tl.constexpr,
                    UPCAST: tl.constexpr, FIX_RNE: tl.constexpr):  # fmt: skip
    """The input-dtype gradient ``g [n_rows, n_cols] = scale_r * dL/dz`` of the vocabulary
    columns ``[v0, v0 + n_cols)`` without the target column, straight from ``h [n_rows, H]``
    and ``W``: the logits GEMM of :func:`lse_tma_kernel` (TMA descriptors, persistent grid of
    ``n_programs``, grouped tiles) with :func:`logits_grad_cols_kernel`'s formula in its
    epilogue, so the float32 logits never leave registers:

        g = exp(s - LSE_r) * p_scale_r - scale_r * eps / V     (times ds/dz with softcap)

    ``s`` the bias-added, softcapped logit; 0 in each row's target column and in every row
    whose label is negative. ``g`` row stride ``stride_g`` (elements); it must not overlap
    ``h`` or ``W``. Each program owns its output tiles; no atomics. ``labels`` int64; ``lse``,
    ``p_scale``, ``scale`` float32 ``[n_rows]``."""
    num_m = tl.cdiv(n_rows, BLOCK_M)
    num_n = tl.cdiv(n_cols, BLOCK_N)
    k_tiles = tl.cdiv(hsize, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, n_programs, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):  # fmt: skip
        pm, pn = _grouped_tile(tile, num_m, num_n, GROUP_M)
        off_m = pm * BLOCK_M
        off_n = pn * BLOCK_N
        acc = _tma_logits_tile(h_desc, w_desc, off_m, v0 + off_n, k_tiles, BLOCK_M, BLOCK_N,
                               BLOCK_K, UPCAST)  # fmt: skip
        cols = off_n + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        rows = off_m + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        y = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        p_scale = tl.load(p_scale_ptr + rows, mask=row_ok, other=0.0)
        scale = p_scale  # read only with label smoothing
        if SMOOTHING:
            scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        x = acc
        if HAS_BIAS:
            bias = tl.load(b_ptr + tl.cast(v0, tl.int64) + cols, mask=col_ok, other=0.0)
            x += bias.to(tl.float32)[None, :]
        g = _grad_tile(x, lse, p_scale, scale, softcap, label_smoothing, vocab, HAS_SOFTCAP,
                       SMOOTHING, FAST_MATH)  # fmt: skip
        keep = (y >= 0)[:, None] & (cols[None, :] != (y - v0)[:, None])
        g = _cast(tl.where(keep, g, 0.0), g_ptr.dtype.element_ty, FIX_RNE)
        out = g_ptr + tl.cast(off_m, tl.int64) * stride_g
        local = tl.arange(0, BLOCK_M)
        tl.store(out + local[:, None] * stride_g + cols[None, :], g,
                 mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip

"""Triton kernels of backend ``"triton"``.

Every kernel works on *counted* rows only (labels already validated by ``loss.py``; no kernel
asserts on the device). Offsets that can exceed 2**31 (row * row_stride of logits, hidden,
weight) are computed in int64. All reductions accumulate in float32.

The gradient of a row's loss with respect to its logits, ``scale * dL/dz_v`` with::

    dL/ds_v = p_v * (1 + 2 * z_loss * LSE) - eps / V - (1 - eps) * 1[v = y]

(``s`` the softcapped logits, times ``1 - (s_v / c)**2`` through a softcap ``c``), is split by
column: the *dense* part, every column except the target, is what the kernels write (in the
input dtype) and what the matmuls consume; the *target column* is one float32 coefficient per
row, ``coef_r = scale_r * dL/dz_{r, y_r}``, added in float32 to dW
(``dW[y] += sum_{r: y_r = y} coef_r * h_r``, :func:`target_dweight_kernel`) and, on the
zero-logits path, to dH (``dH_r += coef_r * W[y_r]``, :func:`dhidden_rows_store_kernel`); the
chunked path writes it into its logits chunk before the dH matmul instead, so that dH is
rounded once, as in PyTorch. On large vocabularies the target column carries most of the
gradient's norm, so adding it in float32 instead of through bf16 partial sums keeps dW's
error below PyTorch's own bf16 path; and ``p_y - 1`` is formed in float32, so a confident row
(``p_y ~ 1``) loses nothing to cancellation.

Sources: Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018) for the
running max/sum; Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (2024)
for computing the log-sum-exp from logit tiles that never leave the chip.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Start value of running maxima: finite, so that ``exp(m_old - m_new)`` never sees inf - inf.
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _softcap(x, cap):
    """``cap * tanh(x / cap)`` written with ``exp`` (``tanh`` is not in every Triton's ``tl``);
    the division is the fast (non-IEEE, ~1 ulp) one."""
    return cap - tl.fdiv(2.0 * cap, tl.exp(x * (2.0 / cap)) + 1.0, ieee_rounding=False)


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in float32. ``UPCAST`` (interpreter only: Triton 3.9's interpreter
    mis-multiplies bfloat16 operands) multiplies exact float32 copies instead."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _cast(x, dtype: tl.constexpr, FIX_RNE: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even. ``FIX_RNE`` (interpreter only: Triton 3.9's
    interpreter truncates float32 to bfloat16) rounds the float32 bits first, so that the
    truncating cast lands on the round-to-nearest-even value."""
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
):
    """One program per row of a ``[r, V]`` logits chunk (input dtype, bias included).

    ``COMPUTE_LSE``: one pass with a running max and per-lane sums; writes ``lse[row]`` and
    the row's loss ``loss[row]`` (float32). Otherwise ``lse[row]`` is read. Both passes
    prefetch ``NUM_STAGES - 1`` blocks ahead (``tl.range`` software pipelining).
    ``WRITE_GRAD``: a second pass overwrites the row with ``scale * dL/dz`` in the input
    dtype, 0 in the target column, and writes that column's value to ``coef[row]`` (float32).
    """
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    y = tl.load(labels_ptr + row)
    z_y = tl.load(z_row + y).to(tl.float32)
    if HAS_SOFTCAP:
        z_y = _softcap(z_y, softcap)

    if COMPUTE_LSE:
        # running max (one number per row: one exp per logit) and per-lane sums relative to it
        m = tl.max(tl.full([BLOCK_V], _NEG_BIG, tl.float32), axis=0)
        s = tl.zeros([BLOCK_V], tl.float32)
        z_sum = tl.zeros([BLOCK_V], tl.float32)
        for v0 in tl.range(0, vocab, BLOCK_V, num_stages=NUM_STAGES):
            mask = v0 + cols < vocab
            x = tl.load(z_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                x = _softcap(x, softcap)
            if SMOOTHING:
                z_sum += tl.where(mask, x, 0.0)
            x = tl.where(mask, x, -float("inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        log_s = tl.log(tl.sum(s, axis=0))
        lse = m + log_s
        # LSE - z_y without rounding LSE first: exact for confident rows (p_y ~ 1) in float32
        nll = (m - z_y) + log_s
        loss = nll
        if SMOOTHING:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (
                lse - tl.sum(z_sum, axis=0) / vocab
            )
        if Z_LOSS:
            loss += z_loss * lse * lse
        tl.store(lse_ptr + row, lse)
        tl.store(nll_ptr + row, nll)
        tl.store(loss_ptr + row, loss)
    else:
        lse = tl.load(lse_ptr + row)
        nll = tl.load(nll_ptr + row)

    if WRITE_GRAD:
        scale = _row_scale(scale_ptr, scale_value, row, SCALE_MODE)
        inv_cap = 1.0 / softcap
        p_scale = scale
        if Z_LOSS:
            p_scale = scale * (1.0 + 2.0 * z_loss * lse)
        for v0 in tl.range(0, vocab, BLOCK_V, num_stages=NUM_STAGES):
            mask = v0 + cols < vocab
            x = tl.load(z_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                x = _softcap(x, softcap)
            g = tl.exp(x - lse) * p_scale
            if SMOOTHING:
                g -= scale * label_smoothing / vocab
            if HAS_SOFTCAP:
                t = x * inv_cap
                g = g * (1.0 - t * t)
            g = tl.where(v0 + cols == y, 0.0, g)
            tl.store(z_row + v0 + cols, _cast(g, z_ptr.dtype.element_ty, FIX_RNE), mask=mask)
        coef = tl.exp(-nll) * p_scale - (1.0 - label_smoothing) * scale  # p_y from nll
        if SMOOTHING:
            coef -= scale * label_smoothing / vocab
        if HAS_SOFTCAP:
            t_y = z_y / softcap
            coef = coef * (1.0 - t_y * t_y)
        tl.store(coef_ptr + row, coef)


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
    hidden_size,
    HAS_PART: tl.constexpr,
    ADD_TARGET: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FIX_RNE: tl.constexpr,
):
    """``dH[out_rows[i]] (+)= part[i] + coef[i] * W[labels[i]]`` in float32, rounded once.

    Grid ``(r, cdiv(H, BLOCK_H))``. ``part`` is ``[r, H]`` (any float dtype; the dense
    ``dz @ W`` of a chunk, or a float32 partial sum); ``dH`` is ``[N, H]``.
    """
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    acc = tl.zeros([BLOCK_H], tl.float32)
    if HAS_PART:
        acc += tl.load(part_ptr + i * stride_part + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_TARGET:
        coef = tl.load(coef_ptr + i)
        y = tl.load(labels_ptr + i).to(tl.int64)
        w = tl.load(w_ptr + y * stride_wv + cols * stride_wk, mask=mask, other=0.0)
        acc += coef * w.to(tl.float32)
    out = tl.load(out_rows_ptr + i).to(tl.int64)
    dst = dh_ptr + out * stride_dh + cols
    if ACCUMULATE:
        acc += tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, _cast(acc, dh_ptr.dtype.element_ty, FIX_RNE), mask=mask)


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
    """Target column's share of dW and db for labels in ``[v_lo, v_hi)``:
    ``dW[y - v_lo] += sum_{r: y_r = y} coef_r * h_r`` and ``db[y] += sum coef_r``.

    Grid ``(M, cdiv(H, BLOCK_H))`` over counted rows sorted by label; the first row of each
    run of equal labels sums the run in float32 and adds it to ``dW`` once (deterministic,
    one rounding). ``order[j]`` maps sorted position ``j`` to the row's index in ``coef`` and
    ``row_off`` (element offsets of the rows in ``hidden``). ``dW`` may be a float32
    accumulator of the rows ``[v_lo, v_hi)`` only.
    """
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    y = tl.load(sorted_labels_ptr + i)
    prev = tl.load(sorted_labels_ptr + i - 1, mask=i > 0, other=-1)
    if (prev != y) & (y >= v_lo) & (y < v_hi):
        acc = tl.zeros([BLOCK_H], tl.float32)
        coef_sum = 0.0
        j = i
        y_j = y
        while y_j == y:
            k = tl.load(order_ptr + j)
            coef = tl.load(coef_ptr + k)
            if NEED_W:
                off = tl.load(row_off_ptr + k)
                h = tl.load(h_ptr + off + cols * stride_hk, mask=mask, other=0.0)
                acc += coef * h.to(tl.float32)
            coef_sum += coef
            j += 1
            y_j = tl.load(sorted_labels_ptr + j, mask=j < n_rows, other=-1)
        y64 = y.to(tl.int64)
        if NEED_W:
            dst = dw_ptr + (y64 - v_lo) * stride_dwv + cols
            acc += tl.load(dst, mask=mask, other=0.0).to(tl.float32)
            tl.store(dst, _cast(acc, dw_ptr.dtype.element_ty, FIX_RNE), mask=mask)
        if NEED_B:
            if tl.program_id(1) == 0:
                tl.store(db_ptr + y64, tl.load(db_ptr + y64) + coef_sum)


@triton.jit
def _logits_tile(
    h_ptr,
    row_off,
    row_mask,
    stride_hk,
    w_ptr,
    cols,
    col_mask,
    stride_wv,
    stride_wk,
    hidden_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``[BLOCK_M, BLOCK_N]`` float32 tile of ``hidden[rows] @ W[cols].T`` (K loop over H)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + row_off[:, None] + ks[None, :] * stride_hk
    b_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wv + ks[None, :] * stride_wk
    for k0 in range(0, hidden_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + ks) < hidden_size
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _dot(a, tl.trans(b), acc, DOT_PRECISION, UPCAST)
        a_ptrs += BLOCK_K * stride_hk
        b_ptrs += BLOCK_K * stride_wk
    return acc


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
):
    """Zero-logits forward: partial statistics of ``BLOCK_M`` counted rows over one split of
    the vocabulary, from logit tiles that stay in registers.

    Grid ``(cdiv(M, BLOCK_M), n_splits)``. Writes ``part[f, split, row]`` (float32) for the
    fields f = 0 running max, 1 sum of exp relative to it, 2 the (softcapped) target logit if
    it lies in this split else 0, 3 the sum of (softcapped) logits in the split.
    """
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    row_off = tl.load(row_off_ptr + rows, mask=row_mask, other=0)
    if ROW_ALIGN > 1:  # lets the gathered hidden-row loads be vectorised and pipelined
        row_off = tl.multiple_of(row_off, ROW_ALIGN)
    y = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
    m = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    z_y = tl.zeros([BLOCK_M], tl.float32)
    z_sum = tl.zeros([BLOCK_M], tl.float32)
    v_begin = split * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, vocab)
    for v0 in range(v_begin, v_end, BLOCK_N):
        cols = v0 + tl.arange(0, BLOCK_N)
        col_mask = cols < v_end
        z = _logits_tile(
            h_ptr, row_off, row_mask, stride_hk, w_ptr, cols, col_mask, stride_wv, stride_wk,
            hidden_size, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION, UPCAST,
        )
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_SOFTCAP:
            z = _softcap(z, softcap)
        if SMOOTHING:
            z_sum += tl.sum(tl.where(col_mask[None, :], z, 0.0), axis=1)
        z_y += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        z = tl.where(col_mask[None, :], z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
    out = part_ptr + split * n_rows + rows
    field = n_splits * n_rows
    tl.store(out, m, mask=row_mask)
    tl.store(out + field, s, mask=row_mask)
    tl.store(out + 2 * field, z_y, mask=row_mask)
    tl.store(out + 3 * field, z_sum, mask=row_mask)


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
):
    """Zero-logits backward for a group of ``n_rows`` counted rows and the vocabulary columns
    ``[v_start, v_start + n_cols)``: recompute each logit tile on chip, form ``scale * dL/dz``
    without the target column and add its products into float32 accumulators with atomics:

        dh_acc[r, :]          += dz[r, tile] @ W[tile, :]      (``[n_rows, H]``)
        dw_acc[v - v_start, :] += dz[:, v]^T @ hidden[rows, :]  (``[n_cols, H]``)
        db[v]                  += sum_r dz[r, v]                 (``[V]``)

    Grid ``(cdiv(n_rows, BLOCK_M), cdiv(n_cols, BLOCK_N))``. The target column is added
    afterwards (module docstring).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = v_start + local
    col_mask = local < n_cols
    row_off = tl.load(row_off_ptr + rows, mask=row_mask, other=0)
    if ROW_ALIGN > 1:  # lets the gathered hidden-row loads be vectorised and pipelined
        row_off = tl.multiple_of(row_off, ROW_ALIGN)
    z = _logits_tile(
        h_ptr, row_off, row_mask, stride_hk, w_ptr, cols, col_mask, stride_wv, stride_wk,
        hidden_size, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION, UPCAST,
    )
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        z = _softcap(z, softcap)
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
        t = z / softcap
        g = g * (1.0 - t * t)
    y = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
    keep = row_mask[:, None] & col_mask[None, :] & (cols[None, :] != y[:, None])
    g = tl.where(keep, g, 0.0)
    if NEED_B:
        tl.atomic_add(db_ptr + cols, tl.sum(g, axis=0), mask=col_mask, sem="relaxed")
    g_in = _cast(g, w_ptr.dtype.element_ty, FIX_RNE)
    hs = tl.arange(0, BLOCK_H)
    for h0 in range(0, hidden_size, BLOCK_H):
        h_mask = (h0 + hs) < hidden_size
        if NEED_H:
            w = tl.load(
                w_ptr + cols.to(tl.int64)[:, None] * stride_wv + (h0 + hs)[None, :] * stride_wk,
                mask=col_mask[:, None] & h_mask[None, :],
                other=0.0,
            )
            dh = _dot(g_in, w, tl.zeros([BLOCK_M, BLOCK_H], tl.float32), DOT_PRECISION, UPCAST)
            tl.atomic_add(
                dh_acc_ptr + rows.to(tl.int64)[:, None] * hidden_size + (h0 + hs)[None, :],
                dh,
                mask=row_mask[:, None] & h_mask[None, :],
                sem="relaxed",
            )
        if NEED_W:
            h = tl.load(
                h_ptr + row_off[:, None] + (h0 + hs)[None, :] * stride_hk,
                mask=row_mask[:, None] & h_mask[None, :],
                other=0.0,
            )
            dw = _dot(
                tl.trans(g_in), h, tl.zeros([BLOCK_N, BLOCK_H], tl.float32), DOT_PRECISION, UPCAST
            )
            tl.atomic_add(
                dw_acc_ptr + local.to(tl.int64)[:, None] * hidden_size + (h0 + hs)[None, :],
                dw,
                mask=col_mask[:, None] & h_mask[None, :],
                sem="relaxed",
            )

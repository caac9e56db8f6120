"""Triton kernels of backend ``"ascend"`` (triton-ascend; the Triton interpreter in CI).

The math is the ``triton`` backend's (its ``kernels`` module docstring): the dense part of
``scale * dL/dz`` (every column but the target) is written by the kernels in the input dtype;
the target column is one float32 coefficient per row, added to dH and dW exactly, with
``p_y = exp(-nll)`` from the unrounded ``nll = LSE - z_y`` (``exp(z_y - LSE)`` would let LSE's
float32 rounding dominate ``p_y - 1`` for confident rows). The kernels are launched by
:class:`~.launch.AscendLaunchers` from the ``triton`` backend's drivers.

What differs for the NPU, and why:

- *Persistent grids.* triton-ascend binds a program to a physical core and runs programs
  beyond the core count in further rounds, at a cost, and a grid axis may not exceed 65535.
  Every kernel here is launched with one program per core (vector cores for vector-only
  kernels, AI cores for kernels with ``tl.dot``) and loops over its rows or tiles with
  ``range(pid, n, num_programs)``; pointers are rebuilt from the loop index in every
  iteration, never carried across tasks.
- *Block sizes* come from :func:`~.config.launch_config`, which keeps each kernel's live tiles
  within the Unified Buffer; the row kernel keeps its running max and sum as scalars (one
  reduction per block) instead of per-lane vectors, so fewer tiles are live.
- *Only operations triton-ascend lists as supported*: ``exp``/``log``/``abs``/``where``,
  ``max``/``sum`` reductions, ``dot`` (fp16/bf16/fp32, ``input_precision="ieee"``), ``trans``
  of 2-D tiles, float32 ``atomic_add`` without using its return value. ``tanh`` is not in
  triton-ascend's op table (nor in upstream ``tl``): the softcap is written with ``exp`` of
  a non-positive argument, which cannot overflow.
- *Offsets*: a row's or tile's base offset is formed as an int64 scalar (``tl.cast``, which
  also works on compile-time constants, unlike ``.to``) and added to int32 in-block indices,
  so offsets past 2**31 are exact while most vector index arithmetic stays 32-bit (int64
  vector arithmetic falls back to scalar code on the NPU). The exception is the per-row
  element offsets of ``hidden`` (``row_off``, int64), which any strides may need.
- *``DOT_F32``, ``RNE_BF16``* (the interpreter only; off on the NPU): upstream Triton 3.9's
  interpreter multiplies bfloat16 ``tl.dot`` operands as raw 16-bit patterns (its
  ``create_dot`` converts only 8-bit floats) and truncates float32 to bfloat16. There, dot
  operands already rounded to bfloat16 are widened to float32 first (the same products,
  exact in float32), and casts to bfloat16 round to nearest even by hand (:func:`_to`).
- *``tl.dot`` operands*: on triton-ascend the left operand's on-chip buffer may be reused for
  the product (flash-linear-attention notes this), so the gradient tile, which feeds several
  dots, is passed as a fresh copy each time.

No kernel asserts on the device: labels were validated by ``loss.py``.

Sources: triton-ascend ``docs/en/programming_guide.md``, ``docs/en/migration_guide/*.md`` and
``docs/sources/python-api/outline.md`` (op support table); flash-linear-attention
``.agents/skills/fla-ascend-performance/references/TRAPS.md``; Milakov & Gimelshein (2018)
for the online log-sum-exp; Wijmans et al. (2024) for logit tiles that never leave the chip.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Start of running maxima: finite, so ``exp(m_old - m_new)`` never sees ``-inf - -inf``.
_NEG_BIG = -1.0e30


@triton.jit
def _softcap(x, cap):
    """``cap * tanh(x / cap)`` with ``tanh(u) = sign(u) (1 - e) / (1 + e)``, ``e = exp(-2|u|)``."""
    u = x / cap
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(u < 0.0, -t, t)


@triton.jit
def _fresh(x):
    """A copy of ``x`` for use as a ``tl.dot`` operand (module docstring)."""
    return x + 0.0


@triton.jit
def _to(x, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """``x.to(dtype)`` rounded to nearest even. ``RNE_BF16`` (interpreter only; upstream
    Triton's interpreter truncates float32 to bfloat16) first rounds the float32 bit pattern
    to the nearest even bfloat16 (NaN kept), so the truncating cast is exact."""
    if RNE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        half = 0x7FFF + ((bits >> 16) & 1)
        rounded = ((bits + half) & 0xFFFF0000).to(tl.float32, bitcast=True)
        x = tl.where(x != x, x, rounded)
    return x.to(dtype)


@triton.jit
def _row_scale(scale_ptr, scale_value, row, SCALE_MODE: tl.constexpr):
    """Upstream multiplier of one row: 0 = a constant, 1 = a 0-d tensor, 2 = one per row."""
    if SCALE_MODE == 0:
        scale = scale_value
    elif SCALE_MODE == 1:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = tl.load(scale_ptr + row).to(tl.float32)
    return scale


@triton.jit
def logits_grad_rows_kernel(
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
    RNE_BF16: tl.constexpr,
):
    """Chunked path: LSE, loss and the logits gradient of the rows of a ``[r, V]`` chunk.

    Grid ``(P,)``, P <= vector cores; program ``p`` handles rows ``p, p + P, ...``.
    ``COMPUTE_LSE``: one pass over the row with a scalar running max and sum; writes
    ``lse[row]``, ``nll[row]`` (``LSE - z_y`` without rounding LSE first) and ``loss[row]``
    (float32). Otherwise ``lse[row]`` and ``nll[row]`` are read.
    ``WRITE_GRAD``: a second pass overwrites the row with ``scale * dL/dz`` in the input
    dtype, 0 in the target column, and writes that column's value to ``coef[row]`` (float32).
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_prog):
        r64 = tl.cast(row, tl.int64)
        z_row = z_ptr + r64 * stride_z
        y = tl.load(labels_ptr + r64)
        z_y = tl.load(z_row + y).to(tl.float32)
        if HAS_SOFTCAP:
            z_y = _softcap(z_y, softcap)

        if COMPUTE_LSE:
            m = _NEG_BIG
            s = 0.0
            z_sum = 0.0
            for v0 in range(0, vocab, BLOCK_V):
                mask = cols < vocab - v0
                x = tl.load(z_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    x = _softcap(x, softcap)
                if SMOOTHING:
                    z_sum += tl.sum(tl.where(mask, x, 0.0), axis=0)
                x = tl.where(mask, x, -float("inf"))
                m_new = tl.maximum(m, tl.max(x, axis=0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
                m = m_new
            log_s = tl.log(s)
            lse = m + log_s
            nll = (m - z_y) + log_s  # not lse - z_y: exact for confident rows in float32
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
            y_in_block = tl.cast(y, tl.int32)  # keeps the column arithmetic 32-bit (V < 2**31)
            scale = _row_scale(scale_ptr, scale_value, r64, SCALE_MODE)
            p_scale = scale
            if Z_LOSS:
                p_scale = scale * (1.0 + 2.0 * z_loss * lse)
            for v0 in range(0, vocab, BLOCK_V):
                mask = cols < vocab - v0
                x = tl.load(z_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    x = _softcap(x, softcap)
                g = tl.exp(x - lse) * p_scale
                if SMOOTHING:
                    g -= scale * label_smoothing / vocab
                if HAS_SOFTCAP:
                    t = x / softcap
                    g = g * (1.0 - t * t)
                g = tl.where(cols == y_in_block - v0, 0.0, g)
                tl.store(z_row + v0 + cols, _to(g, z_ptr.dtype.element_ty, RNE_BF16), mask=mask)
            coef = tl.exp(-nll) * p_scale - (1.0 - label_smoothing) * scale  # p_y from nll
            if SMOOTHING:
                coef -= scale * label_smoothing / vocab
            if HAS_SOFTCAP:
                t_y = z_y / softcap
                coef = coef * (1.0 - t_y * t_y)
            tl.store(coef_ptr + r64, coef)


@triton.jit
def dhidden_rows_kernel(
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
    RNE_BF16: tl.constexpr,
):
    """``dH[out_rows[i]] (+)= part[i] + coef[i] * W[labels[i]]`` in float32, rounded once.

    Grid ``(P,)``, P <= vector cores; each program loops over rows ``i`` and, within a row,
    over blocks of ``H``. ``part`` is ``[r, H]`` (any float dtype), ``dH`` is ``[N, H]``.
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    hs = tl.arange(0, BLOCK_H)
    for i in range(pid, n_rows, n_prog):
        i64 = tl.cast(i, tl.int64)
        dst_row = dh_ptr + tl.load(out_rows_ptr + i64).to(tl.int64) * stride_dh
        part_row = part_ptr + i64 * stride_part
        if ADD_TARGET:
            coef = tl.load(coef_ptr + i64)
            w_row = w_ptr + tl.load(labels_ptr + i64).to(tl.int64) * stride_wv
        for h0 in range(0, hidden_size, BLOCK_H):
            mask = hs < hidden_size - h0
            acc = tl.zeros([BLOCK_H], tl.float32)
            if HAS_PART:
                acc += tl.load(part_row + h0 + hs, mask=mask, other=0.0).to(tl.float32)
            if ADD_TARGET:
                w = tl.load(w_row + (h0 + hs) * stride_wk, mask=mask, other=0.0)
                acc += coef * w.to(tl.float32)
            if ACCUMULATE:
                acc += tl.load(dst_row + h0 + hs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dst_row + h0 + hs, _to(acc, dh_ptr.dtype.element_ty, RNE_BF16), mask=mask)


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
    RNE_BF16: tl.constexpr,
):
    """Target part of dW and db for labels in ``[v_lo, v_hi)``:
    ``dW[y - v_lo] += sum_{r: y_r = y} coef_r h_r``, ``db[y] += sum coef_r``.

    Counted rows are sorted by label on the host; run ``k`` (one distinct label
    ``run_labels[k]``) covers sorted positions ``[run_starts[k], run_starts[k + 1])``, and
    ``order[j]`` maps sorted position ``j`` to the row's index in ``coef`` and ``row_off``.
    Grid ``(P,)``, P <= vector cores; each program owns whole runs, so every ``dW`` row is
    written by one program, once per ``H`` block, with one rounding (deterministic, no atomics).
    ``dW`` may be a float32 accumulator of the rows ``[v_lo, v_hi)`` only.
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    hs = tl.arange(0, BLOCK_H)
    for k in range(pid, n_runs, n_prog):
        k64 = tl.cast(k, tl.int64)
        y = tl.load(run_labels_ptr + k64).to(tl.int64)
        if (y >= v_lo) & (y < v_hi):
            start = tl.load(run_starts_ptr + k64)
            end = tl.load(run_starts_ptr + k64 + 1)
            if NEED_B:
                coef_sum = 0.0
                for j in range(start, end):
                    coef_sum += tl.load(coef_ptr + tl.load(order_ptr + j))
                tl.store(db_ptr + y, tl.load(db_ptr + y) + coef_sum)
            if NEED_W:
                dst_row = dw_ptr + (y - v_lo) * stride_dwv
                for h0 in range(0, hidden_size, BLOCK_H):
                    mask = hs < hidden_size - h0
                    acc = tl.zeros([BLOCK_H], tl.float32)
                    for j in range(start, end):
                        r = tl.load(order_ptr + j)
                        coef = tl.load(coef_ptr + r)
                        h_row = h_ptr + tl.load(row_off_ptr + r)
                        h = tl.load(h_row + (h0 + hs) * stride_hk, mask=mask, other=0.0)
                        acc += coef * h.to(tl.float32)
                    acc += tl.load(dst_row + h0 + hs, mask=mask, other=0.0).to(tl.float32)
                    out = _to(acc, dw_ptr.dtype.element_ty, RNE_BF16)
                    tl.store(dst_row + h0 + hs, out, mask=mask)


@triton.jit
def _logits_tile(
    h_ptr,
    row_off,
    row_mask,
    stride_hk,
    w_ptr,
    v0,
    col_mask,
    stride_wv,
    stride_wk,
    hidden_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """``[BLOCK_M, BLOCK_N]`` float32 tile of ``hidden[rows] @ W[v0 : v0 + BLOCK_N].T``."""
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
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    return acc


@triton.jit
def lse_forward_tiles_kernel(
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
    DOT_F32: tl.constexpr,
):
    """Zero-logits forward: per (row block, vocabulary split) task, partial statistics of
    ``BLOCK_M`` counted rows from logit tiles that never leave the chip.

    Grid ``(P,)``, P <= AI cores; task ``t = row_block * n_splits + split`` goes to program
    ``t % P``. Writes ``part[f, split, row]`` (float32) for the fields f = 0 running max,
    1 sum of exp relative to it, 2 the (softcapped) target logit if it lies in this split
    else 0, 3 the sum of (softcapped) logits in the split.
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_tasks = tl.cdiv(n_rows, BLOCK_M) * n_splits
    field = tl.cast(n_splits, tl.int64) * n_rows
    for task in range(pid, n_tasks, n_prog):
        block = task // n_splits
        split = task % n_splits
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        row_off = tl.load(row_off_ptr + rows, mask=row_mask, other=0)
        y = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
        m = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
        s = tl.zeros([BLOCK_M], tl.float32)
        z_y = tl.zeros([BLOCK_M], tl.float32)
        z_sum = tl.zeros([BLOCK_M], tl.float32)
        v_begin = split * vocab_per_split
        v_end = tl.minimum(v_begin + vocab_per_split, vocab)
        for v0 in range(v_begin, v_end, BLOCK_N):
            local = tl.arange(0, BLOCK_N)
            col_mask = local < v_end - v0
            z = _logits_tile(
                h_ptr, row_off, row_mask, stride_hk, w_ptr, v0, col_mask, stride_wv, stride_wk,
                hidden_size, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32,
            )
            if HAS_BIAS:
                bias = tl.load(b_ptr + tl.cast(v0, tl.int64) + local, mask=col_mask, other=0.0)
                z += bias.to(tl.float32)[None, :]
            if HAS_SOFTCAP:
                z = _softcap(z, softcap)
            if SMOOTHING:
                z_sum += tl.sum(tl.where(col_mask[None, :], z, 0.0), axis=1)
            z_y += tl.sum(tl.where(local[None, :] == (y - v0)[:, None], z, 0.0), axis=1)
            z = tl.where(col_mask[None, :], z, -float("inf"))
            m_new = tl.maximum(m, tl.max(z, axis=1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
            m = m_new
        out = part_ptr + tl.cast(split, tl.int64) * n_rows + rows
        tl.store(out, m, mask=row_mask)
        tl.store(out + field, s, mask=row_mask)
        tl.store(out + 2 * field, z_y, mask=row_mask)
        tl.store(out + 3 * field, z_sum, mask=row_mask)


@triton.jit
def dhidden_dweight_tiles_kernel(
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
    DOT_F32: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """Zero-logits backward for ``n_rows`` counted rows and the vocabulary columns
    ``[v_start, v_start + n_cols)``: per (row block, vocabulary tile) task, recompute the
    logit tile on chip, form the dense part of ``scale * dL/dz`` and add its products into
    float32 accumulators with atomics (their return values unused):

        dh_acc[r, :]             += dz[r, tile] @ W[tile, :]       (``[n_rows, H]``)
        dw_acc[v - v_start, :]   += dz[:, v]^T @ hidden[rows, :]   (``[n_cols, H]``)
        db[v]                    += sum_r dz[r, v]                  (``[V]``)

    Grid ``(P,)``, P <= AI cores; task ``t`` is row block ``t % n_row_blocks`` of vocabulary
    tile ``t // n_row_blocks`` (programs running together share a weight tile).
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    row_blocks = tl.cdiv(n_rows, BLOCK_M)
    n_tasks = row_blocks * tl.cdiv(n_cols, BLOCK_N)
    local = tl.arange(0, BLOCK_N)
    hs = tl.arange(0, BLOCK_H)
    for task in range(pid, n_tasks, n_prog):
        r0 = (task % row_blocks) * BLOCK_M
        c0 = (task // row_blocks) * BLOCK_N
        rows = r0 + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        col_mask = local < n_cols - c0
        v0 = v_start + c0
        row_off = tl.load(row_off_ptr + rows, mask=row_mask, other=0)
        z = _logits_tile(
            h_ptr, row_off, row_mask, stride_hk, w_ptr, v0, col_mask, stride_wv, stride_wk,
            hidden_size, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32,
        )
        if HAS_BIAS:
            bias = tl.load(b_ptr + tl.cast(v0, tl.int64) + local, mask=col_mask, other=0.0)
            z += bias.to(tl.float32)[None, :]
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
        keep = row_mask[:, None] & col_mask[None, :] & (local[None, :] != (y - v0)[:, None])
        g = tl.where(keep, g, 0.0)
        if NEED_B:
            tl.atomic_add(db_ptr + tl.cast(v0, tl.int64) + local, tl.sum(g, axis=0),
                          mask=col_mask)  # fmt: skip
        g_in = _to(g, w_ptr.dtype.element_ty, RNE_BF16)  # rounded as the cube's operands are
        if DOT_F32:
            g_in = g_in.to(tl.float32)
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
                if DOT_F32:
                    w = w.to(tl.float32)
                dh = tl.dot(_fresh(g_in), w, input_precision="ieee")
                tl.atomic_add(
                    dh_rows + tl.arange(0, BLOCK_M)[:, None] * hidden_size + (h0 + hs)[None, :],
                    dh,
                    mask=row_mask[:, None] & h_mask[None, :],
                )
            if NEED_W:
                h = tl.load(
                    h_ptr + row_off[:, None] + (h0 + hs)[None, :] * stride_hk,
                    mask=row_mask[:, None] & h_mask[None, :],
                    other=0.0,
                )
                if DOT_F32:
                    h = h.to(tl.float32)
                dw = tl.dot(tl.trans(_fresh(g_in)), h, input_precision="ieee")
                tl.atomic_add(
                    dw_rows + local[:, None] * hidden_size + (h0 + hs)[None, :],
                    dw,
                    mask=col_mask[:, None] & h_mask[None, :],
                )

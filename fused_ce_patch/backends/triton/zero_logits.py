"""Zero-logits path of backends ``"triton"`` and ``"ascend"`` (``logits_budget=0``): no logits
kept between forward and backward, and no memory for them beyond dH, dW and a few MiB. The
kernels are called through ``cfg.launchers``
(:class:`~.launch.Launchers`): the CUDA kernels named below by default, the NPU's
persistent-grid variants for backend ``"ascend"``.

Forward on NVIDIA GPUs with TMA (Hopper on; :func:`tma_forward_rows`): every row through one
Triton GEMM whose epilogue keeps the logits tile in registers and writes only each row's
max / sum of exponentials / target logit / sum of logits per block of columns
(:func:`~.kernels.lse_tma_kernel`), merged slice by slice into a running state
(:func:`~.kernels.lse_merge_kernel`); on an H200 it runs at cuBLAS's speed for the logits
matmul alone (BENCHMARKS.md, 2026-12-02 night). With many rows per hidden unit the same
statistics come per run of column blocks, the whole vocabulary in one launch
(:func:`~.kernels.lse_tma_runs_kernel`, ``launch.TMA_RUNS_MIN_ROWS_PER_HIDDEN``).
Elsewhere, where hidden needs a gradient (:func:`matmul_forward_rows`): cuBLAS matmuls over
chunks of vocabulary columns, each chunk's float32 logits (all rows, at most ``H / 2``
columns: no more memory than the dH that backward allocates) merged by
:func:`~.kernels.lse_cols_kernel` into the same running state (:func:`lse_state_by_matmul`).
Elsewhere (:func:`~.kernels.lse_forward_kernel`): each program multiplies a block of counted
rows with the weight rows of one split of the vocabulary, tile by tile in registers, and keeps
the same running values; the splits fill the GPU. Either way a few small torch ops turn them
into one float32 LSE and one loss per counted row.

Backward, where it applies (16-bit inputs, dH and dW both wanted, ``V >= 2N``, not too many
rows per hidden unit; :func:`.zero_logits_inplace.plan`): :mod:`.zero_logits_inplace`, one
vocabulary chunk of recomputed logits at a time in dH's and dW's not-yet-filled storage,
cuBLAS matmuls that each own their output — exact, bitwise repeatable, no float32 atomics,
2.2-3.6x faster than the tiled backward below on an H200 (BENCHMARKS.md, 2026-12-02); on
Hopper each chunk's gradient comes from one TMA GEMM with the gradient in its epilogue, and
it runs up to N/H = 64 (Gemma-3-270M at 32K tokens: 122 ms against the tiled 162).

Backward elsewhere, the tiled kernels (:func:`~.kernels.dhidden_dweight_backward_kernel`): the
logit tiles are recomputed, turned into ``scale * dL/dz`` without each row's target column and
multiplied into float32 accumulators with atomics (so the float32 summation order, and the
last bits, may differ run to run); the target column (one float32 coefficient per row,
kernels module docstring) joins the same float32 accumulators before they are rounded.
Gradients are exact (no filtering of small softmax values). Memory beyond dH and dW stays
under 8 MiB:

- dW (16-bit weights) is accumulated in float32 *inside its own storage*: the vocabulary is
  processed in groups of halving size; a group of ``c`` rows takes ``2c`` rows of dW's free
  storage as a float32 accumulator, and when the group is done its rows are rounded once into
  their final 16-bit place at the front of that region (a copy in passes of doubling length,
  whose source and destination never overlap). A last small group uses a separate buffer.
  float32 weights accumulate directly in dW.
- dH is accumulated in float32 for one group of rows at a time (at most 4 MiB) and added to
  dH once per vocabulary group: with 16-bit inputs dH is rounded about ``log2(V / 64)`` times,
  the earlier roundings holding only the (small) non-target columns' share; the target
  column is added with the last group. When the weight needs no gradient (e.g. a frozen
  lm_head under LoRA) the vocabulary is one group and dH is rounded once.

Speed of the tiled backward: the float32 atomics bound it (about ``N*H*V/64`` element adds at
128 x 128 tiles; 128 x 256 where ``H <= 1024`` and the GPU has the shared memory); on an H200
it was 2.4-3.8x slower than Cut Cross-Entropy's filtered default. It still runs at Gemma-3's
shape (32K rows, H = 640) off Hopper, where the in-place backward with float32 logits is
bandwidth-bound and slower.

Source: Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (2024), for the
tiled forward and the recomputing backward; Milakov & Gimelshein (2018) for the online LSE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import single_backward
from ..base import LossSpec
from ..chunked import finish_loss
from . import zero_logits_inplace
from .launch import (CUDA_LAUNCHERS, Launchers, row_offsets, tma_device, tma_operands,
                     triton_cdiv)

#: float32 accumulator of dH for one group of rows (bytes).
DH_GROUP_BYTES = 4 * 2**20
#: Separate float32 accumulator for the last, small vocabulary group (bytes).
DW_TAIL_BYTES = 1 * 2**20


@dataclass
class ZeroLogitsConfig:
    spec: LossSpec
    reduction: str  # "none" | "sum"
    scale: float | torch.Tensor
    n_valid: int
    launchers: Launchers = CUDA_LAUNCHERS
    #: grad mode on and hidden requiring grad (``ctx.needs_input_grad`` ignores grad mode)
    need_hidden_grad: bool = True


def lse_forward(hidden, row_off, weight, bias, labels, spec: LossSpec,
                launchers: Launchers = CUDA_LAUNCHERS, by_matmul=None):  # fmt: skip
    """Per counted row: ``(loss, lse, z_target, nll)`` (float32 ``[M]``), logits never stored;
    ``nll = LSE - z_target`` computed without rounding LSE first.

    Args:
        hidden: ``[..., H]`` hidden states (any strides); rows are read at ``row_off``.
        row_off: ``[M]`` int64 element offsets of the counted rows in ``hidden``.
        weight: ``[V, H]``; bias: ``[V]`` or None; labels: ``[M]`` int64 targets in [0, V).
        launchers: whose ``lse_forward_partials`` kernel to run.
        by_matmul: None (the Triton forward), or ``(h2, all_labels, valid_rows)``: every row
            of ``h2 [N, H]`` through :func:`lse_state_by_matmul` (``all_labels`` ``[N]``; an
            ignored row's label is only compared, never used as an index, and its state is
            dropped), then the counted rows ``valid_rows`` taken; with a fourth item True,
            through ``launchers.lse_tma`` (:func:`tma_forward_rows`) instead.
    """
    m = labels.shape[0]
    vocab = weight.shape[0]
    if m == 0:
        empty = torch.empty(0, dtype=torch.float32, device=hidden.device)
        return empty, empty, empty, empty
    if by_matmul is not None:
        h2, all_labels, valid_rows, *tma = by_matmul
        if tma and tma[0]:
            state = _initial_state(h2.shape[0], h2.device)
            launchers.lse_tma(h2, weight, bias, all_labels, state, spec)
        else:
            state = lse_state_by_matmul(h2, weight, bias, all_labels, spec, launchers)
        part = state.index_select(1, valid_rows).unsqueeze(1)  # one split of [M] rows
    else:
        part = launchers.lse_forward_partials(hidden, row_off, weight, bias, labels, spec)
    run_max, run_sum, z_t, z_s = part.unbind(0)
    top = run_max.amax(0)
    log_s = (run_sum * torch.exp(run_max - top)).sum(0).log()
    lse = top + log_s
    z_t = z_t.sum(0)
    # (max - z_t) + log(sum), not lse - z_t: exact for confident rows in float32
    nll = (top - z_t) + log_s
    loss = finish_loss(lse, z_t, z_s.sum(0), vocab, spec, nll=nll)
    return loss, lse, z_t, nll


#: Whether the forward may run as cuBLAS matmuls over vocabulary chunks (tests switch it off
#: to reach the Triton forward).
MATMUL_FORWARD = True
#: Fewest counted rows (a fraction of all rows) for the matmul forward, which multiplies every
#: row: the Triton forward ran at ~360 TFLOP/s against cuBLAS's ~600 on an H200 (Gemma-2,
#: BENCHMARKS.md 2026-12-02 evening), so all rows pay while at most ~40 % are ignored (an
#: estimate from those rates; measured at 10 % ignored only).
MATMUL_FORWARD_MIN_COUNTED = 0.6


#: Start of the running maxima (the kernels' ``_NEG_BIG``): a chunk whose logits are all -inf
#: (a -inf bias masking tokens) leaves it finite.
NEG_BIG = -1.0e30


def matmul_forward_rows(hidden, weight, launchers, need_h: bool, n_valid: int):
    """``hidden`` as one ``[N, H]`` matrix where the forward runs as cuBLAS matmuls, else None.

    The forward then holds float32 logits of at most ``H / 2`` columns of all ``N`` rows —
    ``N * H`` 16-bit elements, the size of the dH that backward allocates — so only when
    hidden needs a gradient (then this transient buffer is not above the step's peak), the
    matmuls take the operands as they are (16-bit, one dtype, unit column strides, float32
    outputs on NVIDIA), ``H >= 16`` (chunks of at least 8 aligned columns), and there are not
    too many rows per hidden unit (the in-place backward's ``MAX_ROWS_PER_HIDDEN``: at
    Gemma-3-270M's 32K rows and H = 640 the chunks are 320 columns, and the forward took
    48-67 ms against the Triton forward's 25 on an H200, while at N/H <= 8 it was 2-17 %
    faster; BENCHMARKS.md, 2026-12-02 evening)."""
    if not (MATMUL_FORWARD and need_h and n_valid > 0 and hasattr(launchers, "lse_cols")):
        return None
    if hidden.device.type == "cuda" and not zero_logits_inplace._cuda_fp32_out_matmuls():
        return None
    h2 = _all_rows(hidden, weight, n_valid, zero_logits_inplace.MAX_ROWS_PER_HIDDEN)
    if h2 is None or h2.stride(1) != 1 or weight.stride(1) != 1:
        return None
    if weight.shape[1] < 2 * zero_logits_inplace.COL_ALIGN:
        return None
    return h2


def _all_rows(hidden, weight, n_valid: int, max_rows_per_hidden: int):
    """What both all-row forwards ask: ``hidden`` as an ``[N, H]`` view of 16-bit operands of
    one dtype, at least :data:`MATMUL_FORWARD_MIN_COUNTED` of its rows counted (every row is
    multiplied) and at most ``max_rows_per_hidden`` rows per hidden unit; else None."""
    if hidden.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != hidden.dtype:
        return None
    hsize = weight.shape[1]
    try:
        h2 = hidden.view(-1, hsize)
    except RuntimeError:
        return None
    n = h2.shape[0]
    if n_valid < MATMUL_FORWARD_MIN_COUNTED * n:
        return None
    if n > max_rows_per_hidden * hsize:
        return None
    return h2


#: Whether the forward may run as :func:`~.kernels.lse_tma_kernel` (tests and probes switch it
#: off to reach the other forwards).
TMA_FORWARD = True
#: Most rows per hidden unit (``N / H``) for which the TMA forward runs: the in-place
#: backward's limit with the TMA gradient, under which it was measured (N/H = 51).
TMA_MAX_ROWS_PER_HIDDEN = zero_logits_inplace.MAX_ROWS_PER_HIDDEN_TMA


def tma_forward_rows(hidden, weight, launchers, n_valid: int):
    """``hidden`` as one ``[N, H]`` matrix where the forward runs as the TMA GEMM with the LSE in
    its epilogue (``launchers.lse_tma``), else None: a :func:`~.launch.tma_device`, 16-bit
    operands of one dtype whose rows are 16-byte aligned (TMA's rule), at least
    :data:`MATMUL_FORWARD_MIN_COUNTED` of the rows counted (every row is multiplied), and at
    most :data:`TMA_MAX_ROWS_PER_HIDDEN` rows per hidden unit. At N/H <= 8 it was 4-22 %
    faster than the matmul forward (BENCHMARKS.md, 2026-12-02 night); at Gemma-3-270M's 32K
    rows and H = 640 (N/H = 51), with runs of column blocks
    (``launch.TMA_RUNS_MIN_ROWS_PER_HIDDEN``), 22.5 ms against the Triton forward's 25.1 on an
    H200 (per-block partials: 26.4; BENCHMARKS.md, 2026-12-03). It keeps no logits, so unlike
    :func:`matmul_forward_rows` it needs no gradient of hidden."""
    if not (TMA_FORWARD and n_valid > 0 and hasattr(launchers, "lse_tma")):
        return None
    h2 = _all_rows(hidden, weight, n_valid, TMA_MAX_ROWS_PER_HIDDEN)
    if h2 is None or not tma_device(hidden.device):
        return None
    return h2 if tma_operands(h2, weight) else None


def _initial_state(n: int, dev) -> torch.Tensor:
    """Running LSE state ``[4, n]`` before any column: max ``NEG_BIG`` (finite, so that
    ``exp(m_old - m_new)`` never sees ``-inf - (-inf)``), sums and target logit 0."""
    state = torch.zeros(4, n, dtype=torch.float32, device=dev)
    state[0].fill_(NEG_BIG)
    return state


def lse_state_by_matmul(h2, weight, bias, labels, spec: LossSpec, launchers) -> torch.Tensor:
    """Running LSE state ``[4, N]`` (float32: max, sum of exponentials, target logit, sum of
    logits) of every row of ``h2 [N, H]`` over the whole vocabulary: per chunk of ``c``
    columns, ``Z = h2 @ W[C].T`` (cuBLAS, float32 output) into one reused buffer, then
    ``launchers.lse_cols`` merges ``Z`` into the state. ``c`` is the in-place backward's
    chunk width (at most ``H / 2``, about the L2 cache's size of float32 logits), so the
    buffer is at most ``N * H`` 16-bit elements and the merge reads ``Z`` from L2."""
    n, hsize = h2.shape
    vocab, dev = weight.shape[0], h2.device
    align = zero_logits_inplace.COL_ALIGN
    width = zero_logits_inplace._chunk_width(n, hsize, dev)
    state = _initial_state(n, dev)
    buf = torch.empty(n * width, dtype=torch.float32, device=dev)
    for v0 in range(0, vocab, width):
        c = min(width, vocab - v0)
        pitch = min(-(-c // align) * align, width)  # rows 16-byte aligned where room allows
        z = buf[: n * pitch].view(n, pitch)[:, :c]
        zero_logits_inplace._mm_fp32_into(z, h2, weight[v0 : v0 + c].t())
        launchers.lse_cols(z, bias, labels, state, v0, spec)
    return state


def _vocab_groups(dw: torch.Tensor | None, vocab: int, hsize: int, dev):
    """``[(v_start, n_cols, acc, dst, in_place)]``: float32 accumulator ``acc [n_cols, H]`` of
    the group, its 16-bit destination rows ``dst`` (None when ``acc`` is dW itself or absent),
    and whether ``acc`` lives in dW's storage from ``dst``'s first byte on."""
    if dw is None:
        return [(0, vocab, None, None, False)]
    if dw.dtype == torch.float32:
        return [(0, vocab, dw, None, False)]
    flat = dw.view(-1)
    tail_rows = max(16, DW_TAIL_BYTES // (4 * hsize))
    groups = []
    start, remaining = 0, vocab
    while remaining > tail_rows:
        size = (remaining - 1) // 2
        e0 = start * hsize
        e0 += e0 % 2  # 4-byte alignment of the float32 view
        acc = flat[e0 : e0 + 2 * size * hsize].view(torch.float32).view(size, hsize)
        groups.append((start, size, acc, dw[start : start + size], True))
        start += size
        remaining -= size
    tail = torch.empty(remaining, hsize, dtype=torch.float32, device=dev)
    groups.append((start, remaining, tail, dw[start:], False))
    return groups


def _round_into(dst: torch.Tensor, acc: torch.Tensor, in_place: bool):
    """``dst[:] = acc`` (float32 → 16-bit). With ``in_place`` the float32 rows live in the same
    storage from ``dst``'s first byte on: copy in passes ``[a, 2a)`` that never overlap."""
    n = dst.shape[0]
    if not in_place:
        dst.copy_(acc)
        return
    dst[:1].copy_(acc[:1].clone())
    a = 1
    while a < n:
        b = min(2 * a, n)
        dst[a:b].copy_(acc[a:b])
        a = b


class TritonZeroLogitsLinearCrossEntropy(torch.autograd.Function):
    """``apply(hidden, weight, bias, labels, valid_rows, cfg)`` → ``[N]`` float32 losses
    (``"none"``) or the 0-d ``scale * sum``. See the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid_rows, cfg: ZeroLogitsConfig):
        y_valid = labels.index_select(0, valid_rows)
        row_off = row_offsets(hidden, valid_rows)
        h2 = tma_forward_rows(hidden, weight, cfg.launchers, cfg.n_valid)
        tma = h2 is not None
        if not tma:
            h2 = matmul_forward_rows(hidden, weight, cfg.launchers,
                                     cfg.need_hidden_grad and ctx.needs_input_grad[0],
                                     cfg.n_valid)  # fmt: skip
        loss, lse, z_t, nll = lse_forward(
            hidden, row_off, weight, bias, y_valid, cfg.spec, cfg.launchers,
            None if h2 is None else (h2, labels.contiguous(), valid_rows, tma),  # unit stride
        )
        ctx.cfg = cfg
        ctx.save_for_backward(hidden, weight, bias, valid_rows, y_valid, row_off, lse, z_t, nll)
        if cfg.reduction == "none":
            out = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device)
            return out.index_copy_(0, valid_rows, loss)
        return loss.sum() * cfg.scale

    @staticmethod
    @single_backward
    def backward(ctx, grad_out):
        cfg: ZeroLogitsConfig = ctx.cfg
        spec, launchers = cfg.spec, cfg.launchers
        hidden, weight, bias, valid_rows, y_valid, row_off, lse, z_t, nll = ctx.saved_tensors
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        m = cfg.n_valid
        vocab, hsize = weight.shape
        dev = hidden.device
        n = hidden.numel() // hsize

        if cfg.reduction == "none":
            scale = grad_out.reshape(-1).to(torch.float32).index_select(0, valid_rows)
        else:
            scale = grad_out.to(torch.float32) * cfg.scale

        # The target column, in float32: coef_r = scale_r * dL/dz_{r, y_r}; it joins the
        # float32 accumulators before their (last) rounding.
        row_scale = scale if scale.dim() == 1 else scale.expand(m)
        # p_y * p_factor - (1 - eps), p_y from nll, not exp(z_t - lse) (lse's rounding would
        # dominate p_y - 1). p_y > 1/2: with p_y - 1 = expm1(-nll), not exp(-nll) - 1 (cancels
        # when nll << 1); else from p_y itself, as (p_factor - (1 - eps)) + p_factor * (p_y - 1)
        # cancels p_factor against itself when the z-loss factor is large
        one_eps = 1.0 - spec.label_smoothing
        p_factor = (1.0 + 2.0 * spec.z_loss * lse) if spec.z_loss else 1.0
        coef = torch.where(nll < math.log(2.0),
                           (p_factor - one_eps) + p_factor * torch.expm1(-nll),
                           p_factor * torch.exp(-nll) - one_eps)
        coef = coef - spec.label_smoothing / vocab
        if spec.softcap is not None:
            coef = coef * (1.0 - (z_t / spec.softcap) ** 2)
        coef = (coef * row_scale).contiguous()
        plan = zero_logits_inplace.plan(hidden, weight, launchers, need_h, need_w, m)
        if plan is not None:
            dh, dw, db = zero_logits_inplace.backward(
                plan, hidden, weight, bias, valid_rows, y_valid, row_off, lse,
                row_scale.contiguous(), coef, spec, launchers, need_b,
            )  # fmt: skip
            return (dh.view(hidden.shape), dw, None if db is None else db.to(bias.dtype),
                    None, None, None)  # fmt: skip

        dh = torch.zeros(n, hsize, dtype=hidden.dtype, device=dev) if need_h else None
        dw = None
        if need_w:
            dw = torch.empty(vocab, hsize, dtype=weight.dtype, device=dev)
            if dw.dtype == torch.float32:
                dw.zero_()
        db = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_b else None

        block_m = launchers.backward_block_m(weight)
        group_rows = max(block_m, DH_GROUP_BYTES // (4 * hsize) // block_m * block_m)
        group_rows = min(group_rows, triton_cdiv(max(m, 1), block_m) * block_m)
        dh_acc = torch.empty(group_rows, hsize, dtype=torch.float32, device=dev) if need_h else None

        by_label = launchers.sort_by_label(y_valid) if (need_w or need_b) else None

        groups = _vocab_groups(dw, vocab, hsize, dev)
        for gi, (v_start, n_cols, acc, dst, in_place) in enumerate(groups):
            last = gi == len(groups) - 1
            if acc is not None and dst is not None:
                acc.zero_()
            for g0 in range(0, m, group_rows):
                r = min(group_rows, m - g0)
                if need_h:
                    dh_acc[:r].zero_()
                rows = slice(g0, g0 + r)
                launchers.dhidden_dweight_backward(
                    hidden, row_off[rows], weight, bias, y_valid[rows], lse[rows],
                    scale[rows] if scale.dim() == 1 else scale,
                    dh_acc if need_h else None, acc, db if need_b else None,
                    v_start, n_cols, spec,
                )  # fmt: skip
                if need_h:
                    launchers.dhidden_rows(
                        dh, valid_rows[rows], part=dh_acc[:r], accumulate=True,
                        coef=coef[rows] if last else None, labels=y_valid[rows], weight=weight,
                    )
            if acc is not None or need_b:
                launchers.target_dweight(
                    acc, db, y_valid, coef, hidden, row_off, v_lo=v_start,
                    v_hi=v_start + n_cols, by_label=by_label,
                )
            if dst is not None:
                _round_into(dst, acc, in_place)

        return (
            None if dh is None else dh.view(hidden.shape),
            dw,
            None if db is None else db.to(bias.dtype),
            None,
            None,
            None,
        )

"""Triton row kernel of the generalized JSD (:mod:`fused_ce_patch.backends.distill_chunked`).

``divergence_rows_inplace``: one program per row of a chunk of both models' raw float32
logits ``xs``, ``xt`` (``[r, V]``, bias included). Three passes over the row, each in blocks
of ``BLOCK`` columns:

1. running max and sum-exp of ``zs = softcap(s_scale xs) / T`` and of ``zt`` alike;
2. with both log-normalisers known: the divergence (or, for 0 < beta < 1, ``KL(ps || m)``
   and ``KL(pt || m)``) and the student entropy;
3. with the row's divergence known: ``row_scale * dD/dxs`` and ``row_scale * dD/dxt``
   (formulas in the driver's module docstring), written to ``gs``/``gt`` in their dtype —
   over ``xs``/``xt`` themselves for float32 models, or to 16-bit buffers that feed the
   dH/dW matmuls directly (no separate cast).

Every element is read and written by the same program, so writing in place is safe.
Arithmetic is float32; the softcap's ``tanh`` and slope come from
:func:`.kernels._tanh_and_slope`, and the rounding to 16 bits from :func:`.kernels._cast`
(the cross-entropy kernels' own; ``FIX_RNE`` on CPU tensors, where the interpreter's own
cast to bfloat16 truncates).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .kernels import _cast, _tanh_and_slope
from .launch import stats_kernel_config

_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _z(x, scale, inv_cap, cap, inv_t, SOFTCAP: tl.constexpr):
    """``softcap(scale * x) / T`` and ``dz/dx``."""
    y = x * scale
    if SOFTCAP:
        t, slope = _tanh_and_slope(y * inv_cap)
        return cap * t * inv_t, slope * (scale * inv_t)
    return y * inv_t, scale * inv_t + 0.0 * y


@triton.jit
def _divergence_rows_kernel(
    xs_ptr, xt_ptr, gs_ptr, gt_ptr, stride_xs, stride_xt, stride_gs, stride_gt,
    d_ptr, ent_ptr, row_scale_ptr, n_cols,
    beta, log_1m_beta, log_beta,
    s_scale, s_inv_cap, s_cap, t_scale, t_inv_cap, t_cap, inv_t,
    MODE: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
    NEED_S: tl.constexpr, NEED_T: tl.constexpr, WANT_ENT: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr, FIX_RNE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    xs_row = xs_ptr + row * stride_xs
    xt_row = xt_ptr + row * stride_xt
    cols = tl.arange(0, BLOCK)

    # pass 1: log-normalisers (running max, sum-exp rescaled on each new max)
    ms = tl.full([BLOCK], _NEG_BIG, tl.float32)
    mt = tl.full([BLOCK], _NEG_BIG, tl.float32)
    ss = tl.zeros([BLOCK], tl.float32)
    st = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < n_cols
        zs, _ = _z(tl.load(xs_row + offs, mask=mask, other=0.0), s_scale, s_inv_cap, s_cap,
                   inv_t, S_SOFTCAP)
        zt, _ = _z(tl.load(xt_row + offs, mask=mask, other=0.0), t_scale, t_inv_cap, t_cap,
                   inv_t, T_SOFTCAP)
        zs = tl.where(mask, zs, _NEG_BIG)
        zt = tl.where(mask, zt, _NEG_BIG)
        ns, nt = tl.maximum(ms, zs), tl.maximum(mt, zt)
        ss = ss * tl.exp(ms - ns) + tl.where(mask, tl.exp(zs - ns), 0.0)
        st = st * tl.exp(mt - nt) + tl.where(mask, tl.exp(zt - nt), 0.0)
        ms, mt = ns, nt
    row_ms, row_mt = tl.max(ms, 0), tl.max(mt, 0)
    # log p = (z - max) - log(sum): a common offset cancels before any rounding at its size
    log_ss = tl.log(tl.sum(ss * tl.exp(ms - row_ms), 0))
    log_st = tl.log(tl.sum(st * tl.exp(mt - row_mt), 0))

    # pass 2: the divergence (MODE 2: both KLs to the mixture) and the entropy
    acc_a = tl.zeros([BLOCK], tl.float32)  # MODE 0/1: D; MODE 2: KL(ps || m)
    acc_b = tl.zeros([BLOCK], tl.float32)  # MODE 2: KL(pt || m)
    acc_e = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < n_cols
        zs, _ = _z(tl.load(xs_row + offs, mask=mask, other=0.0), s_scale, s_inv_cap, s_cap,
                   inv_t, S_SOFTCAP)
        zt, _ = _z(tl.load(xt_row + offs, mask=mask, other=0.0), t_scale, t_inv_cap, t_cap,
                   inv_t, T_SOFTCAP)
        ls, lt = (zs - row_ms) - log_ss, (zt - row_mt) - log_st
        ps = tl.where(mask, tl.exp(ls), 0.0)
        pt = tl.where(mask, tl.exp(lt), 0.0)
        if WANT_ENT:
            acc_e += ps * ls
        if MODE == 0:
            acc_a += pt * (lt - ls)
        elif MODE == 1:
            acc_a += ps * (ls - lt)
        else:
            a, b = ls + log_1m_beta, lt + log_beta
            top = tl.maximum(a, b)
            log_m = top + tl.log(tl.exp(a - top) + tl.exp(b - top))
            acc_a += ps * (ls - log_m)
            acc_b += pt * (lt - log_m)
    kl_a = tl.sum(acc_a, 0)
    kl_b = tl.sum(acc_b, 0)
    if MODE == 2:
        d = beta * kl_b + (1.0 - beta) * kl_a
    else:
        d = kl_a
    tl.store(d_ptr + row, d)
    if WANT_ENT:
        tl.store(ent_ptr + row, -tl.sum(acc_e, 0))

    # pass 3: the gradients, scaled by the row's upstream weight
    if NEED_S or NEED_T:
        if HAS_ROW_SCALE:
            g = tl.load(row_scale_ptr + row)
        else:
            g = 1.0
        gs_row = gs_ptr + row * stride_gs
        gt_row = gt_ptr + row * stride_gt
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            zs, slope_s = _z(tl.load(xs_row + offs, mask=mask, other=0.0), s_scale, s_inv_cap,
                             s_cap, inv_t, S_SOFTCAP)
            zt, slope_t = _z(tl.load(xt_row + offs, mask=mask, other=0.0), t_scale, t_inv_cap,
                             t_cap, inv_t, T_SOFTCAP)
            ls, lt = (zs - row_ms) - log_ss, (zt - row_mt) - log_st
            ps, pt = tl.exp(ls), tl.exp(lt)
            if MODE == 0:
                dzs = ps - pt
                dzt = pt * (lt - ls - d)
            elif MODE == 1:
                dzs = ps * (ls - lt - d)
                dzt = pt - ps
            else:
                a, b = ls + log_1m_beta, lt + log_beta
                top = tl.maximum(a, b)
                log_m = top + tl.log(tl.exp(a - top) + tl.exp(b - top))
                dzs = (1.0 - beta) * ps * (ls - log_m - kl_a)
                dzt = beta * pt * (lt - log_m - kl_b)
            if NEED_S:
                gs = _cast(dzs * slope_s * g, gs_ptr.dtype.element_ty, FIX_RNE)
                tl.store(gs_row + offs, gs, mask=mask)
            if NEED_T:
                gt = _cast(dzt * slope_t * g, gt_ptr.dtype.element_ty, FIX_RNE)
                tl.store(gt_row + offs, gt, mask=mask)


def divergence_rows_inplace(xs, xt, spec, need_s: bool, need_t: bool, want_entropy: bool,
                            row_scale=None, s_out_dtype=torch.float32,
                            t_out_dtype=torch.float32):
    """Launch :func:`_divergence_rows_kernel` on one chunk.

    Args:
        xs, xt: ``[r, V]`` float32 raw logits, unit column stride; overwritten by the
            gradients when those are float32.
        spec: :class:`~fused_ce_patch.backends.distill_chunked.DivergenceSpec`.
        need_s, need_t: which gradients to write.
        want_entropy: whether to compute the student entropy.
        row_scale: ``[r]`` float32 upstream weights of the rows, or None (1).
        s_out_dtype, t_out_dtype: dtype of each gradient (float32: in place; 16-bit: a new
            ``[r, V]`` buffer).

    Returns:
        ``(D [r], entropy [r] or None, gs or None, gt or None)``.
    """
    r, v = xs.shape
    dev = xs.device
    d = torch.empty(r, dtype=torch.float32, device=dev)
    ent = torch.empty(r, dtype=torch.float32, device=dev) if want_entropy else d
    gs = (xs if s_out_dtype == torch.float32 else torch.empty(r, v, dtype=s_out_dtype,
                                                                device=dev)) if need_s else xs
    gt = (xt if t_out_dtype == torch.float32 else torch.empty(r, v, dtype=t_out_dtype,
                                                                device=dev)) if need_t else xt
    beta = spec.beta
    mode = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
    inner = 0.0 < beta < 1.0
    s_cap = spec.student_softcap or 1.0
    t_cap = spec.teacher_softcap or 1.0
    # the launch of the per-token statistics kernel, whose per-lane accumulators are alike
    # (2048 columns a step, 4 warps, 8 with softcap; measured on an H200 for that kernel only)
    cfg = stats_kernel_config(v, dev, softcap=spec.student_softcap is not None
                              or spec.teacher_softcap is not None)
    if r:
        _divergence_rows_kernel[(r,)](
            xs, xt, gs, gt, xs.stride(0), xt.stride(0), gs.stride(0), gt.stride(0),
            d, ent, row_scale if row_scale is not None else d, v,
            float(beta), math.log1p(-beta) if inner else 0.0, math.log(beta) if inner else 0.0,
            float(spec.student_scale), 1.0 / s_cap, float(s_cap),
            float(spec.teacher_scale), 1.0 / t_cap, float(t_cap), 1.0 / spec.temperature,
            MODE=mode, S_SOFTCAP=spec.student_softcap is not None,
            T_SOFTCAP=spec.teacher_softcap is not None, NEED_S=need_s, NEED_T=need_t,
            WANT_ENT=want_entropy, HAS_ROW_SCALE=row_scale is not None, BLOCK=cfg.block_v,
            FIX_RNE=dev.type == "cpu", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return d, (ent if want_entropy else None), (gs if need_s else None), (
        gt if need_t else None)

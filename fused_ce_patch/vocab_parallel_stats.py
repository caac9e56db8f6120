"""Vocabulary-parallel per-token statistics: :func:`vocab_parallel_linear_token_stats`, the
:func:`~fused_ce_patch.fused_linear_token_stats` of an lm_head whose weight is split along the
vocabulary over a process group (docs/design.md §8).

Every rank holds the same counted rows and one contiguous vocabulary shard ``W[v0 : v0 + V_r]``.
With ``z = T(h W_r^T + b_r)`` (``T``: logit scale, softcap, temperature)::

    forward, chunk by chunk of rows and tile by tile of the shard (online over the tiles):
        m_r = max z, first column attaining it ; s_r = sum exp(z - m_r)
        t_r = z_y if y is local else 0 ; e_r = sum exp(z - m_r) z ; q_r = sum exp(z - m_r)^2
        u_r = sum z                  (e_r, q_r, u_r only when their field is asked for)
    all-reduce MAX  m                                    [M]
    all-reduce SUM  [s_r a, t_r, e_r a, q_r a^2, u_r]    [M, 2..5], a = exp(m_r - m)
    all-reduce MIN  first global column with z = m       [M] int64 (accuracy only)
    LSE = m + log s ; log_probs = t - LSE ; entropy = LSE - e / s
    mean_logits = u / V ; log_sum_sq_probs = log q - 2 log s

    backward, the same tiles again (logits recomputed):
        dz = g_lp (1[v = y] - p) - g_ent p (z - sum_u p_u z_u), through T
        dW_r = dz^T h ; db_r = sum dz (this rank's shard) ; dH_r += dz W_r
    all-reduce SUM  dH                                   [M, H] float32 (float64)

The tile arithmetic is the single-device tiled backend's (:func:`~fused_ce_patch.backends.
token_stats.forward_tile` / ``backward_tile``), so a world of one equals
``fused_linear_token_stats(..., backend="torch")``.

Source: Shoeybi et al., "Megatron-LM" (2019), §3, for the vocabulary-parallel softmax statistics
(max and sums all-reduced, the target logit from the rank that owns it); Wijmans et al., "Cut
Your Losses in Large-Vocabulary Language Models" (2024), for the chunked, logits-free
computation. Both are reimplemented here.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import tile_policy
from .backends.token_stats import (
    _CELL_BYTES_COMPILED,
    _CELL_BYTES_EAGER,
    DEFAULT_BUDGET,
    Transform,
    _addmm_acc,
    _compile_wanted,
    _tile_fn,
    backward_tile,
    forward_tile,
    tile_shape,
)
from .errors import single_backward
from .loss import check_logits_budget
from .token_stats import TokenStats
from .vocab_parallel import _int_option, _is_number, prepare_shard_call

_FIELDS = ("entropy", "accuracy", "mean_logits", "log_sum_sq_probs")


def vocab_parallel_linear_token_stats(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    bias_shard: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
    entropy: bool = False,
    accuracy: bool = False,
    mean_logits: bool = False,
    log_sum_sq_probs: bool = False,
    logits_budget: int | None = None,
    check_replicated: bool = True,
) -> TokenStats:
    """Per-token log-probabilities (and optionally entropy, top-1 hits, mean logit and
    ``log sum p^2``) of ``hidden @ W.T (+ b)`` where ``W`` is split along the vocabulary over
    ``group``, from this rank's shard ``weight_shard = W[vocab_start : vocab_start + V_r]``.

    The values are those of :func:`~fused_ce_patch.fused_linear_token_stats` on the whole
    weight (same definitions: ``z = c * tanh(s * x / c) / t``, ``log_probs = z_y - LSE(z)``,
    ``entropy = LSE - sum_v p_v z_v``, ``is_top1`` with the first-maximum rule of
    ``torch.argmax`` over the whole vocabulary), identical on every rank.

    Collective: every rank of ``group`` must call it with the same ``hidden``, ``labels`` and
    options, and the shards must tile ``[0, vocab_size)`` (checked). Backward is collective
    too: every rank must backpropagate the same loss of the outputs (the outputs are
    replicated, so a loss computed from them is). Gradients flow from ``log_probs`` with any
    per-position upstream gradient and from ``entropy`` when requested: ``weight_shard`` and
    ``bias_shard`` get this rank's shard of ``dW`` / ``db``, ``hidden`` the whole ``dH``
    (summed over the group in backward, one all-reduce). Ignored positions get 0 / False and
    no gradient.

    Args:
        hidden: ``[..., H]`` float16, bfloat16, float32 or float64, the same on every rank.
        weight_shard: ``[V_r, H]`` rows ``vocab_start .. vocab_start + V_r - 1`` of the lm_head
            weight, same dtype and device (under ``torch.autocast`` both are cast as
            ``lm_head(hidden)`` would be); ``V_r`` may be 0.
        labels: ``hidden.shape[:-1]`` int64 (or int32) global vocabulary ids in
            ``[0, vocab_size)`` or ``ignore_index``, the same on every rank.
        vocab_start: index of this shard's first row in the whole vocabulary.
        vocab_size: ``V``, rows of the whole weight.
        group: the tensor-parallel process group (None: the default group).
        bias_shard: ``[V_r]`` the matching slice of the bias, or None.
        ignore_index: label of positions that are not scored.
        shift: position ``t`` scores ``labels[..., t + 1]`` (the last position is ignored).
        softcap: ``c > 0`` or None. logit_scale: ``s`` (finite, != 0). temperature: ``t > 0``.
        entropy: also return the entropy (differentiable).
        accuracy: also return ``is_top1``.
        mean_logits, log_sum_sq_probs: also return ``mean_v z_v`` / ``log sum_v p_v^2`` over
            the whole vocabulary (no gradient).
        logits_budget: bytes of transient tile work (float32 cells, float64 for float64
            inputs) one tile of this rank's shard may hold; 0 takes the smallest tiles; None
            the tiled backend's default capped by TRL's logits tile for these rows
            (:func:`fused_ce_patch.tile_policy.logits_budget` with ``TRL_LOGPROB``).
        check_replicated: before computing, all-gather a 7-number fingerprint of every rank's
            call and raise unless the ranks agree and the shards tile the vocabulary (one tiny
            collective and one host synchronisation).

    Returns:
        :class:`~fused_ce_patch.TokenStats` ``(log_probs, entropy, is_top1, mask,
        mean_logits, log_sum_sq_probs)``, each ``labels``-shaped; float fields float32
        (float64 for float64 inputs); unrequested fields None.

    Raises:
        TypeError: non-tensor or non-floating inputs, differing dtypes, non-integer labels, an
            option of the wrong type (bools refused for numbers, only bools for flags).
        ValueError: shapes that disagree (both named), a label outside ``[0, vocab_size)``
            that is not ``ignore_index`` (names it and V), a shard outside the vocabulary, an
            option out of range, ranks whose calls differ or whose shards do not tile ``V``.
        RuntimeError: ``torch.distributed`` is not initialised.

    Source: Shoeybi et al., "Megatron-LM" (2019) for the vocabulary-parallel softmax
    statistics; Wijmans et al. (2024) for the chunked computation (module docstring).
    """
    _check_options(softcap, logit_scale, temperature)
    check_logits_budget(logits_budget)
    flags = {"entropy": entropy, "accuracy": accuracy, "mean_logits": mean_logits,
             "log_sum_sq_probs": log_sum_sq_probs, "shift": shift,
             "check_replicated": check_replicated}
    for name, flag in flags.items():
        if not isinstance(flag, bool):  # "no" is truthy
            raise TypeError(f"{name} must be True or False, got {type(flag).__name__} {flag!r}")
    ignore_index = _int_option("ignore_index", ignore_index)
    vocab_start = _int_option("vocab_start", vocab_start)
    vocab_size = _int_option("vocab_size", vocab_size)
    hidden, weight_shard, bias_shard, labels, counted, valid_rows = prepare_shard_call(
        "vocab_parallel_linear_token_stats", group, hidden, weight_shard, bias_shard, labels,
        ignore_index=ignore_index, shift=shift, vocab_start=vocab_start, vocab_size=vocab_size,
        check_replicated=check_replicated)
    flat, n_valid, shard = labels.reshape(-1), valid_rows.shape[0], weight_shard.shape[0]

    h = hidden.reshape(-1, hidden.shape[-1])
    all_rows = n_valid == flat.shape[0]
    if not all_rows:
        h = h.index_select(0, valid_rows)
    y = flat if all_rows else flat.index_select(0, valid_rows)
    compiled = _compile_wanted(forward_tile, hidden.device) and _compile_wanted(
        backward_tile, hidden.device)
    cell = (_CELL_BYTES_COMPILED if compiled else _CELL_BYTES_EAGER) * (
        2 if hidden.dtype == torch.float64 else 1)
    if logits_budget is None:
        budget = tile_policy.logits_budget(n_valid, vocab_size, hidden.dtype,
                                           tile_policy.TRL_LOGPROB, DEFAULT_BUDGET)
    else:
        budget = max(logits_budget, 1)  # 0: one cell, i.e. 1 x 1 tiles
    rows, block = tile_shape(max(n_valid, 1), max(shard, 1), budget, cell)
    cfg = _Config(
        group=group,
        transform=Transform(float(logit_scale), None if softcap is None else float(softcap),
                            float(temperature)),
        rows=rows, block=block, vocab_start=vocab_start, vocab_size=vocab_size,
        entropy=entropy, accuracy=accuracy, mean_logits=mean_logits,
        log_sum_sq_probs=log_sum_sq_probs,
    )
    with torch.autocast(hidden.device.type, enabled=False):
        out = _VocabParallelTokenStats.apply(h, weight_shard, bias_shard, y, cfg)

    def scatter(x):
        if x is None:
            return None
        if not all_rows:
            # index_put keeps the result connected to autograd even with zero counted rows
            x = x.new_zeros(flat.shape).index_put((valid_rows,), x)
        return x.view(labels.shape)

    lp, ent, top1, mean_z, log_sq = out
    return TokenStats(scatter(lp), scatter(ent), scatter(top1), counted.view(labels.shape),
                      scatter(mean_z), scatter(log_sq))


@dataclass
class _Config:
    group: object
    transform: Transform
    rows: int  # counted rows per tile
    block: int  # shard columns per tile
    vocab_start: int
    vocab_size: int
    entropy: bool
    accuracy: bool
    mean_logits: bool
    log_sum_sq_probs: bool


class _VocabParallelTokenStats(torch.autograd.Function):
    """``(log_probs, entropy, is_top1, mean_logits, log_sum_sq_probs)`` of ``M`` counted rows;
    unrequested fields None; only the first two carry gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, cfg: _Config):
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        m_rows, shard, dev = hidden.shape[0], weight.shape[0], hidden.device
        tf = cfg.transform
        fold = _tile_fn(forward_tile, dev)
        consts = (acc, tf.logit_scale, tf.softcap, tf.temperature)
        wanted = (cfg.entropy, cfg.log_sum_sq_probs, cfg.mean_logits)

        def new(fill, dtype=acc):
            return torch.full((m_rows,), fill, dtype=dtype, device=dev)

        # this shard's running statistics (online over its tiles), as the single-device loop
        run_max, sum_exp, target = new(-math.inf), new(0.0), new(0.0)
        z_exp = new(0.0) if cfg.entropy else None
        sq_exp = new(0.0) if cfg.log_sum_sq_probs else None
        z_sum = new(0.0) if cfg.mean_logits else None
        best_at = new(0, torch.int64) if cfg.accuracy else None
        for r0 in range(0, m_rows, cfg.rows):
            r1 = min(r0 + cfg.rows, m_rows)
            h, y = hidden[r0:r1], labels[r0:r1]
            for v0 in range(0, shard, cfg.block):
                v1 = min(v0 + cfg.block, shard)
                x = h @ weight[v0:v1].t()
                y_local = y - (cfg.vocab_start + v0)
                top, at, new_max, alpha, s_e, s_ez, s_ee, s_z, picked = fold(
                    x, None if bias is None else bias[v0:v1], y_local, run_max[r0:r1],
                    *consts, *wanted)
                del x
                if best_at is not None:
                    # strictly greater: an earlier tile keeps a tie (torch.argmax's rule)
                    better = top > run_max[r0:r1]
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

        lse = log_probs = ent = top1 = mean_z = log_sq = None
        if m_rows:
            m = run_max.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=cfg.group)
            # one SUM for every row quantity; a rank without a shard adds 0 * exp(-inf) = 0
            a = torch.exp(run_max - m)
            cols = [sum_exp * a, target]
            if z_exp is not None:
                cols.append(z_exp * a)
            if sq_exp is not None:
                cols.append(sq_exp * (a * a))
            if z_sum is not None:
                cols.append(z_sum)
            sums = torch.stack(cols, dim=1)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=cfg.group)
            if best_at is not None:
                # first maximum overall: the smallest global column attaining the global max
                first = torch.where(run_max == m, best_at + cfg.vocab_start, cfg.vocab_size)
                dist.all_reduce(first, op=dist.ReduceOp.MIN, group=cfg.group)
                top1 = first == labels
            s, k = sums[:, 0], 2
            lse = m + torch.log(s)
            log_probs = sums[:, 1] - lse
            if z_exp is not None:
                ent, k = lse - sums[:, k] / s, k + 1
            if sq_exp is not None:
                log_sq, k = torch.log(sums[:, k]) - 2.0 * torch.log(s), k + 1
            if z_sum is not None:
                mean_z = sums[:, k] / cfg.vocab_size
        else:  # nothing counted anywhere (labels are replicated): no collective
            empty = hidden.new_zeros(0, dtype=acc)
            lse = log_probs = empty
            ent = empty.clone() if cfg.entropy else None
            top1 = torch.zeros(0, dtype=torch.bool, device=dev) if cfg.accuracy else None
            mean_z = empty.clone() if cfg.mean_logits else None
            log_sq = empty.clone() if cfg.log_sum_sq_probs else None
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.mark_non_differentiable(*(t for t in (top1, mean_z, log_sq) if t is not None))
        return log_probs, ent, top1, mean_z, log_sq

    @staticmethod
    @single_backward
    def backward(ctx, g_lp, g_ent, *_non_differentiable):
        cfg: _Config = ctx.cfg
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        acc = lse.dtype
        tf = cfg.transform
        m_rows, shard = hidden.shape[0], weight.shape[0]
        g_lp = None if g_lp is None else g_lp.to(acc)
        g_ent = None if g_ent is None else g_ent.to(acc)
        grad_tile = _tile_fn(backward_tile, hidden.device)
        consts = (acc, tf.logit_scale, tf.softcap, tf.temperature, hidden.dtype, bool(need_b))
        dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        dw = torch.empty_like(weight) if need_w else None
        db = torch.empty_like(bias) if need_b else None
        # vocabulary blocks outside: each dW block is complete after its rows
        for v0 in range(0, shard, cfg.block):
            v1 = min(v0 + cfg.block, shard)
            w_blk = weight[v0:v1]
            b_blk = None if bias is None else bias[v0:v1]
            dw_blk = torch.zeros(w_blk.shape, dtype=acc, device=weight.device) if need_w else None
            db_blk = torch.zeros(v1 - v0, dtype=acc, device=weight.device) if need_b else None
            for r0 in range(0, m_rows, cfg.rows):
                r1 = min(r0 + cfg.rows, m_rows)
                h = hidden[r0:r1]
                dz, db_part = grad_tile(
                    h @ w_blk.t(), b_blk, labels[r0:r1] - (cfg.vocab_start + v0), lse[r0:r1],
                    None if g_ent is None else ent[r0:r1],
                    None if g_lp is None else g_lp[r0:r1],
                    None if g_ent is None else g_ent[r0:r1], *consts)
                if need_b:
                    db_blk.add_(db_part)
                if need_h:
                    _addmm_acc(dh[r0:r1], dz, w_blk)
                if need_w:
                    _addmm_acc(dw_blk, dz.t(), h)
                del dz
            if need_w:
                dw[v0:v1] = dw_blk.to(weight.dtype)
            if need_b:
                db[v0:v1] = db_blk.to(bias.dtype)
        if dh is not None and m_rows:
            # the stock column-parallel head all-reduces its input gradient the same way
            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=cfg.group)
        return None if dh is None else dh.to(hidden.dtype), dw, db, None, None


def _check_options(softcap, logit_scale, temperature):
    for name, value in (("softcap", softcap), ("logit_scale", logit_scale),
                        ("temperature", temperature)):
        if value is None and name == "softcap":
            continue
        if not _is_number(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__} "
                            f"{value!r}")
    if softcap is not None and not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap}")
    if not (math.isfinite(logit_scale) and logit_scale != 0):
        raise ValueError(f"logit_scale must be a finite non-zero number, got {logit_scale}")
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")

"""Vocabulary-parallel fused linear cross-entropy: the loss of a tensor-parallel lm_head whose
weight is split along the vocabulary over a process group, without any rank holding the
``[tokens, vocab]`` logits (docs/design.md §8).

Every rank of ``group`` holds the same hidden states and labels (they are replicated across
tensor-parallel ranks) and one contiguous vocabulary shard ``W[v0 : v0 + V_r]``. Per counted
row (label != ``ignore_index``)::

    forward, chunk by chunk of rows and tile by tile of the local shard (budget-bounded):
        z = h W_r^T (+ b_r)                    local logits, softcapped if asked
        m_r = max z ; s_r = sum exp(z - m_r)   online over the tiles
        t_r = z_y if y in [v0, v0 + V_r) else 0 ; u_r = sum z   (label smoothing only)
    all-reduce MAX  m        ([M] floats)          -> m
    all-reduce SUM  [s_r exp(m_r - m), t_r, u_r]   ([M, 2 or 3] floats)
    LSE = m + log s ; loss = (m - t) + log s, then smoothing and z-loss as on one device

    backward, the same chunks again (logits recomputed):
        dz = scale * dL/dz  on the local shard, from the saved LSE
        dW_r += dz^T h ; db_r += sum dz ; dH_r += dz W_r
    all-reduce SUM  dH  ([M, H] floats; what a column-parallel linear's backward reduces)

so each rank writes its own weight (and bias) gradient shard, and every rank ends with the
whole hidden-state gradient, exactly as the stock tensor-parallel head whose logits are
all-gathered. The chunk arithmetic is the ``torch`` backend's (:class:`~fused_ce_patch.backends.
torch_chunked.TorchKernel`: float32 work, float64 for float64 inputs; the log-sum-exp kept in
float64 for the gradient), so results match the single-device loss to rounding.

Source: Shoeybi et al., "Megatron-LM" (2019), §3, for the vocabulary-parallel cross-entropy
(max and sum-exp all-reduced, the target logit from the rank that owns it); Wijmans et al.,
"Cut Your Losses in Large-Vocabulary Language Models" (2024), for computing it in chunks
without storing the logits. Both are reimplemented here.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .backends.base import LossSpec
from .backends.chunked import RowSource, finish_loss, plan_chunks
from .backends.torch_chunked import DEFAULT_BUDGET, MIN_TILE_BYTES, TorchKernel
from .errors import LabelOutOfRangeError, single_backward
from .loss import check_logits_budget

REDUCTIONS = ("mean", "sum", "none")
_KERNEL = TorchKernel()


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    bias_shard: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | float | torch.Tensor | None = None,
    shift: bool = False,
    softcap: float | None = None,
    logit_scale: float | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logits_budget: int | None = None,
    check_replicated: bool = True,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ W.T (+ b)`` where ``W`` is split along the vocabulary over
    ``group``, from this rank's shard ``weight_shard = W[vocab_start : vocab_start + V_r]``.

    Collective: every rank of ``group`` must call it with the same ``hidden``, ``labels`` and
    options (tensor-parallel ranks hold replicated activations), and the ranks' shards must
    tile ``[0, vocab_size)`` without gaps or overlap (checked). The result, the loss of the
    whole vocabulary, is the same on every rank. Gradients: ``weight_shard`` and
    ``bias_shard`` get this rank's shard of ``dW`` and ``db``; ``hidden`` gets the whole
    ``dH``, summed over the group in backward (one all-reduce), as after an all-gathered
    column-parallel ``lm_head``. Backward is collective too: call it on every rank.

    Per counted position, with logits ``z`` (``s * z`` with ``logit_scale=s``, then
    ``c * tanh(z / c)`` with ``softcap=c``) the loss is that of
    :func:`~fused_ce_patch.fused_linear_cross_entropy` (docs/design.md §1).

    Args:
        hidden: ``[..., H]`` float16, bfloat16, float32 or float64 last hidden states, the
            same on every rank of ``group``.
        weight_shard: ``[V_r, H]`` rows ``vocab_start .. vocab_start + V_r - 1`` of the lm_head
            weight, same dtype and device as ``hidden`` (``V_r`` may be 0).
        labels: ``hidden.shape[:-1]`` int64 (or int32) targets in ``[0, vocab_size)`` (global
            vocabulary ids) or ``ignore_index``, the same on every rank.
        vocab_start: index of this shard's first row in the whole vocabulary.
        vocab_size: ``V``, rows of the whole (unsharded) weight.
        group: the tensor-parallel process group (None: the default group).
        bias_shard: ``[V_r]`` the matching slice of the lm_head bias, or None.
        ignore_index: label of positions that add nothing to the loss, counts or gradients.
        reduction: ``"mean"`` (0.0 with zero gradients when nothing is counted), ``"sum"``
            or ``"none"`` (``labels``-shaped float32 losses, float64 for float64 inputs).
        num_items_in_batch: divide the sum by this instead (int, float or one-element tensor),
            as transformers' Trainer does; any value as stock divides (0 gives inf, or NaN
            when nothing is counted, with stock's gradients; NaN gives NaN).
        shift: position ``t`` predicts ``labels[..., t + 1]`` (labels are the input ids).
        softcap: final-logit softcap ``c > 0`` (Gemma-2), or None.
        logit_scale: multiply the logits by this finite nonzero number (``(s h) W^T + s b``)
            before the softcap, or None; or a one-element floating tensor (a learnable scale:
            its gradient, the whole vocabulary's, reaches it on every rank).
        label_smoothing: ``eps`` in ``[0, 1]``, torch's definition (mean over all ``V``).
        z_loss: ``lambda >= 0`` of the PaLM z-loss ``lambda * LSE**2``.
        logits_budget: bytes of transient logits one chunk of this rank's shard may hold
            (rows x shard columns x work bytes); 0 takes the smallest tiles; None the ``torch``
            backend's default (192 MiB).
        check_replicated: before computing, all-gather an 8-number fingerprint of every rank's
            call (row counts, label and hidden checksums, shard bounds, labels out of range)
            and raise unless the ranks agree and the shards tile the vocabulary. One tiny
            collective and one host synchronisation; turn off only where the caller
            guarantees it.

    Returns:
        A 0-d float32 loss (float64 for float64 inputs), equal on every rank, or per-position
        losses of ``labels``' shape with ``reduction="none"``.

    Raises:
        TypeError: non-tensor or non-floating inputs, differing dtypes, non-integer labels, or
            an option of the wrong type (bools are refused for numeric options).
        ValueError: shapes that disagree (both named), a label outside ``[0, vocab_size)``
            that is not ``ignore_index`` (names it and V), a shard outside the vocabulary, an
            option out of range, ranks whose calls differ or whose shards do not tile ``V``.
        RuntimeError: ``torch.distributed`` is not initialised.

    Source: Shoeybi et al., "Megatron-LM" (2019) for the vocabulary-parallel cross-entropy;
    Wijmans et al. (2024) for the chunked, logits-free computation (module docstring).
    """
    _check_options(reduction, num_items_in_batch, softcap, logit_scale, label_smoothing, z_loss)
    check_logits_budget(logits_budget)
    ignore_index = _int_option("ignore_index", ignore_index)
    vocab_start = _int_option("vocab_start", vocab_start)
    vocab_size = _int_option("vocab_size", vocab_size)
    for name, flag in (("shift", shift), ("check_replicated", check_replicated)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {type(flag).__name__} {flag!r}")
    hidden, weight_shard, bias_shard, labels, counted, valid_rows = prepare_shard_call(
        "vocab_parallel_linear_cross_entropy", group, hidden, weight_shard, bias_shard, labels,
        ignore_index=ignore_index, shift=shift, vocab_start=vocab_start, vocab_size=vocab_size,
        check_replicated=check_replicated)
    flat, n_valid, shard = labels.reshape(-1), valid_rows.shape[0], weight_shard.shape[0]

    if logit_scale is not None:  # (s h) W^T + s b = s (h W^T + b); autograd sees the products
        hidden = hidden * logit_scale
        if bias_shard is not None:
            if isinstance(logit_scale, torch.Tensor) and logit_scale.requires_grad:
                # s is replicated, b sharded: the bias term of ds is a sum over every shard
                logit_scale = _SumGradOverGroup.apply(logit_scale, group)
            bias_shard = bias_shard * logit_scale
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    spec = LossSpec(
        ignore_index=ignore_index,
        softcap=None if softcap is None else float(softcap),
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
    )
    if logits_budget is None:
        budget = DEFAULT_BUDGET
    else:
        budget = logits_budget or MIN_TILE_BYTES
    plan = plan_chunks(
        n_valid,
        max(shard, 1),
        _KERNEL.bytes_per_logit(hidden.dtype, spec),
        budget,
        bytes_per_column=_KERNEL.bytes_per_column(hidden.dtype, hidden.shape[-1]),
    )
    cfg = _Config(
        group=group,
        spec=spec,
        rows=plan.rows,
        tile=plan.vocab_tile,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        n_valid=n_valid,
        reduction="none" if reduction == "none" else "sum",
        scale=_scale(reduction, num_items_in_batch, n_valid, hidden.device, acc),
    )
    with torch.autocast(hidden.device.type, enabled=False):
        out = _VocabParallelCE.apply(hidden, weight_shard, bias_shard, flat, valid_rows, cfg)
    return out.view(labels.shape) if reduction == "none" else out


def dtensor_vocab_shard(weight, bias=None):
    """This rank's shard of a vocabulary-sharded ``DTensor`` lm_head weight (and bias).

    The layout ``torch.distributed.tensor.distribute_tensor(W, mesh, [Shard(0)])`` gives (what
    transformers' ``colwise`` tensor-parallel styles and torch's ``ColwiseParallel`` make of an
    ``nn.Linear``'s weight): a 1-D mesh, ``torch.chunk`` split of the rows (the last ranks may
    hold fewer, or none).

    Args:
        weight: ``[V, H]`` ``DTensor`` with placements ``(Shard(0),)``.
        bias: ``[V]`` ``DTensor`` with placements ``(Shard(0),)``, or None.

    Returns:
        ``(weight_shard, bias_shard, vocab_start, vocab_size, group)``: the local tensors
        (``to_local()``, so their gradients reach the ``DTensor`` parameters with the same
        placement), the shard's first row, ``V``, and the mesh's process group.

    Raises:
        ValueError: another layout (names its mesh and placements) or a local shard whose
            size is not what ``Shard(0)`` gives.
    """
    from torch.distributed.tensor import DTensor, Shard

    def layout(t):
        return f"placements {tuple(t.placements)} on a {t.device_mesh.ndim}-D mesh"

    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, DTensor):
            raise ValueError(f"{name} must be a DTensor, got {type(t).__name__}")
        if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
            raise ValueError(
                f"{name} has {layout(t)}; only a vocabulary split over a 1-D mesh "
                f"(placements (Shard(dim=0),)) is computed vocabulary-parallel"
            )
    if bias is not None and bias.device_mesh != weight.device_mesh:
        raise ValueError("weight and bias are sharded over different device meshes")
    mesh = weight.device_mesh
    vocab = weight.shape[0]
    ranks, rank = mesh.size(), mesh.get_local_rank()
    per = -(-vocab // ranks)  # torch.chunk: ceil(V / ranks) rows each, the rest on the last
    start = min(rank * per, vocab)
    size = max(0, min(per, vocab - start))
    local = weight.to_local()
    if local.shape[0] != size:
        raise ValueError(
            f"weight's local shard has {local.shape[0]} rows where Shard(0) of {vocab} rows "
            f"over {ranks} ranks gives rank {rank} {size} rows"
        )
    local_bias = None if bias is None else bias.to_local()
    return local, local_bias, start, vocab, mesh.get_group()


# -- the autograd function --------------------------------------------------------------------


@dataclass
class _Config:
    group: object
    spec: LossSpec
    rows: int  # counted rows per chunk
    tile: int  # shard columns per tile
    vocab_start: int
    vocab_size: int
    n_valid: int
    reduction: str  # "none" | "sum"
    scale: float | torch.Tensor


def _chunks(rows: RowSource, labels, valid_rows, cfg: _Config):
    dense = cfg.n_valid == labels.shape[0] and rows.flat is not None
    for start in range(0, cfg.n_valid, cfg.rows):
        end = min(start + cfg.rows, cfg.n_valid)
        idx = valid_rows[start:end]
        if dense:  # every row counted: chunks are views
            yield start, end, rows.flat[start:end], labels[start:end]
        else:
            yield start, end, rows.take(idx), labels.index_select(0, idx)


def _tiles(shard: int, tile: int):
    for v0 in range(0, shard, tile):
        yield v0, min(v0 + tile, shard)


def _logits(h, weight, bias, v0, v1):
    w = weight[v0:v1]
    if bias is None:
        return torch.mm(h, w.t())
    return torch.addmm(bias[v0:v1], h, w.t())


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid_rows, cfg: _Config):
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        device, m_rows, spec = hidden.device, cfg.n_valid, cfg.spec
        rows = RowSource(hidden)
        m = torch.full((m_rows,), -math.inf, dtype=acc, device=device)
        # columns: sum-exp relative to m, target logit (0 off-shard), sum of logits
        sums = torch.zeros(m_rows, 3 if spec.label_smoothing else 2, dtype=acc, device=device)
        for start, end, h, y in _chunks(rows, labels, valid_rows, cfg):
            cm = cs = None
            for v0, v1 in _tiles(weight.shape[0], cfg.tile):
                z = _logits(h, weight, bias, v0, v1)
                tm, ts, tzt, tzs = _KERNEL.tile_stats(z, y, cfg.vocab_start + v0, spec)
                del z
                if cm is None:
                    cm, cs = tm, ts
                else:
                    new = torch.maximum(cm, tm)
                    cs = cs * torch.exp(cm - new) + ts * torch.exp(tm - new)
                    cm = new
                sums[start:end, 1] += tzt
                if spec.label_smoothing:
                    sums[start:end, 2] += tzs
            if cm is not None:
                m[start:end] = cm
                sums[start:end, 0] = cs
        lse = torch.zeros(m_rows, dtype=torch.float64, device=device)
        loss = torch.zeros(m_rows, dtype=acc, device=device)
        if m_rows:
            global_m = m.clone()
            dist.all_reduce(global_m, op=dist.ReduceOp.MAX, group=cfg.group)
            # a rank without a shard (m = -inf, sum 0) adds 0 * exp(-inf) = 0
            sums[:, 0] *= torch.exp(m - global_m)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=cfg.group)
            log_se = torch.log(sums[:, 0])
            zt = sums[:, 1]
            zs = sums[:, 2] if spec.label_smoothing else None
            lse_acc = global_m + log_se
            loss = finish_loss(lse_acc, zt, zs, cfg.vocab_size, spec, nll=(global_m - zt) + log_se)
            # float64 LSE for the gradient: a float32 one is off by ~5e-7, i.e. 5e-4 relative
            # in p_y - 1 when p_y ~= 0.999 (TorchKernel.precise_lse)
            lse = global_m.double() + log_se.double()
        ctx.cfg = cfg
        ctx.save_for_backward(hidden, weight, bias, labels, valid_rows, lse)
        if cfg.reduction == "none":
            out = torch.zeros(labels.shape[0], dtype=acc, device=device)
            return out.index_copy_(0, valid_rows, loss.to(acc))
        return loss.sum(dtype=acc) * cfg.scale

    @staticmethod
    @single_backward
    def backward(ctx, grad_out):
        cfg: _Config = ctx.cfg
        hidden, weight, bias, labels, valid_rows, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        device, hsize, shard = hidden.device, weight.shape[1], weight.shape[0]
        dh = torch.zeros(cfg.n_valid, hsize, dtype=acc, device=device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=device) if need_w else None
        db = torch.zeros(shard, dtype=acc, device=device) if need_b and bias is not None else None
        nonfinite = False
        if cfg.reduction == "none":
            row_scale = grad_out.reshape(-1).to(acc).index_select(0, valid_rows)
        else:
            scale = grad_out.to(acc) * cfg.scale
            # num_items_in_batch 0 or NaN with counted rows: stock's infs and NaNs (one host
            # read, only then; with no counted row there is nothing to compute)
            nonfinite = cfg.n_valid > 0 and not _is_finite(cfg.scale)
        tile_grad = _nonfinite_tile_grad if nonfinite else _KERNEL.tile_grad_
        whole = cfg.tile >= shard
        rows = RowSource(hidden)
        for start, end, h, y in _chunks(rows, labels, valid_rows, cfg):
            s = row_scale[start:end] if cfg.reduction == "none" else scale
            for v0, v1 in _tiles(shard, cfg.tile):
                z = _logits(h, weight, bias, v0, v1)
                dz = tile_grad(
                    z, y, cfg.vocab_start + v0, cfg.vocab_size, lse[start:end], cfg.spec, s
                )
                del z
                w = weight[v0:v1]
                if dh is not None:
                    if dz.dtype == w.dtype:
                        dh[start:end].addmm_(dz, w)
                    elif whole:  # one matmul in the input dtype, as the chunked backend does
                        dh[start:end] += torch.mm(dz.to(w.dtype), w)
                    else:  # tile partials are summed unrounded (TorchKernel.tile_dh_fp32)
                        dh[start:end].addmm_(dz, w.to(acc))
                if dw is not None:
                    dw[v0:v1].addmm_(dz.t(), h if h.dtype == acc else h.to(acc))
                if db is not None:
                    db[v0:v1] += dz.sum(0)
                del dz  # before the next tile's logits: one logits buffer alive, not two
        dhidden = None
        if dh is not None:
            if cfg.n_valid:
                # the stock column-parallel head all-reduces its input gradient the same way
                dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=cfg.group)
            dhidden = torch.zeros(rows.lead_shape.numel(), hsize, dtype=hidden.dtype, device=device)
            dhidden.index_copy_(0, valid_rows, dh.to(hidden.dtype))
            dhidden = dhidden.view(hidden.shape)
        return (
            dhidden,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            None,
            None,
            None,
        )


class _SumGradOverGroup(torch.autograd.Function):
    """Identity in forward; backward sums the gradient over ``group`` (a replicated input used
    with this rank's shard only, whose whole gradient is the sum of the shards' parts)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def _is_finite(scale) -> bool:
    if isinstance(scale, torch.Tensor):
        return bool(torch.isfinite(scale).all())
    return math.isfinite(scale)


def _nonfinite_tile_grad(z, y, v0, vocab, lse, spec, s):
    """``s * dL/dz`` of a tile for a non-finite ``s`` (``num_items_in_batch`` 0 or NaN), in
    the order autograd evaluates stock's chain, so that its infs and NaNs land where stock's
    do. ``F.cross_entropy`` is ``log_softmax`` then nll (and the smoothing term); with ``g``
    the gradient of the log-probabilities, ``log_softmax``'s backward is ``g - p * sum(g)``:
    at the target ``-s + p s`` (NaN for an infinite ``s``), elsewhere ``p s`` (NaN where
    ``p`` is 0). Then the z-loss term ``2 lambda LSE p s`` and the softcap's ``1 - tanh^2``.

    Source: torch 2.13 ``aten/src/ATen/native/LossNLL.cpp`` (``cross_entropy`` with label
    smoothing) and ``SoftMax.cpp`` (``log_softmax`` backward), as single-process autograd
    (``backends/nonfinite_scale.py``) runs them.
    """
    acc = s.dtype
    x = z.to(acc)
    capped = x if spec.softcap is None else torch.tanh(x / spec.softcap) * spec.softcap
    p = torch.exp(capped.double() - lse.unsqueeze(1)).to(acc)
    eps = spec.label_smoothing
    nll = -((1.0 - eps) * s)  # the target's entry of g
    if eps:
        smooth = -(s * (eps / vocab))  # every entry of g
        total = nll + smooth * vocab
        dx = smooth - p * total
    else:
        total = nll
        dx = -(p * total)
    inside = (y >= v0) & (y < v0 + p.shape[1])
    rows = inside.nonzero().squeeze(1)
    cols = (y - v0).index_select(0, rows)
    dx[rows, cols] += nll
    if spec.z_loss:
        dx = dx + (2.0 * spec.z_loss) * lse.to(acc).unsqueeze(1) * p * s
    if spec.softcap is not None:
        dx = dx * (1.0 - torch.tanh(x / spec.softcap).square())
    return dx


# -- validation -------------------------------------------------------------------------------


def _is_number(value, kind) -> bool:
    return isinstance(value, kind) and not isinstance(value, (bool, torch.Tensor))


def _int_option(name, value) -> int:
    if not _is_number(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_options(reduction, num_items, softcap, logit_scale, label_smoothing, z_loss):
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; valid: {', '.join(REDUCTIONS)}")
    if num_items is not None:
        if reduction == "none":
            raise ValueError("num_items_in_batch cannot be combined with reduction='none'")
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1:
                raise ValueError(
                    f"num_items_in_batch must hold one number, got shape {tuple(num_items.shape)}"
                )
        elif not _is_number(num_items, numbers.Real):
            raise TypeError(
                f"num_items_in_batch must be an int, a float or a one-element tensor, got "
                f"{type(num_items).__name__} {num_items!r}"
            )
    if isinstance(logit_scale, torch.Tensor):  # e.g. a learnable scale: stays in the graph
        if logit_scale.numel() != 1 or not logit_scale.is_floating_point():
            raise TypeError(
                f"a tensor logit_scale must be one floating-point number, got shape "
                f"{tuple(logit_scale.shape)} {logit_scale.dtype}"
            )
        logit_scale = None  # its value is not read here (no host synchronisation)
    for name, value, ok, what in (
        ("softcap", softcap, lambda v: 0 < v < math.inf, "None or a finite number > 0"),
        ("logit_scale", logit_scale, lambda v: v != 0 and math.isfinite(v),
         "None or a finite nonzero number"),
    ):
        if value is None:
            continue
        if not _is_number(value, numbers.Real):
            raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
        if not ok(value):
            raise ValueError(f"{name} must be {what}, got {value}")
    for name, value, ok, what in (
        ("label_smoothing", label_smoothing, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
        ("z_loss", z_loss, lambda v: 0.0 <= v < math.inf, "a finite number >= 0"),
    ):
        if not _is_number(value, numbers.Real):
            raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
        if not ok(value):
            raise ValueError(f"{name} must be {what}, got {value}")


def _autocast(hidden, weight, bias):
    """Cast as ``lm_head(hidden)`` would be under autocast (float64 is left alone)."""
    if not isinstance(hidden, torch.Tensor) or not torch.is_autocast_enabled(hidden.device.type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(hidden.device.type)

    def cast(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == torch.float64:
            return t
        return t.to(dtype)

    return cast(hidden), cast(weight), cast(bias)


def _check_tensors(hidden, weight, labels, bias):
    for name, t in (("hidden", hidden), ("weight_shard", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias_shard must be a tensor or None, got {type(bias).__name__}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden [..., H] and weight_shard [V_r, H] disagree: hidden {tuple(hidden.shape)}, "
            f"weight_shard {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have hidden's leading shape: labels {tuple(labels.shape)}, hidden "
            f"{tuple(hidden.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"bias_shard must be [V_r] = [{weight.shape[0]}], got {tuple(bias.shape)}"
        )
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be floating point, got {hidden.dtype}")
    for name, t in (("weight_shard", weight), ("bias_shard", bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise TypeError(f"hidden is {hidden.dtype} but {name} is {t.dtype}; cast one of them")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be an integer tensor (int64 or int32), got {labels.dtype}")
    for name, t in (("weight_shard", weight), ("labels", labels), ("bias_shard", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"hidden is on {hidden.device} but {name} is on {t.device}")


def prepare_shard_call(what, group, hidden, weight_shard, bias_shard, labels, *, ignore_index,
                       shift, vocab_start, vocab_size, check_replicated):
    """What every vocabulary-parallel function does before computing: the process group, autocast
    and tensor checks, the shard's bounds, the (shifted) labels and their counted rows, and the
    cross-rank check — before a rank's out-of-range label raises, so that no rank raises alone.

    Returns:
        ``(hidden, weight_shard, bias_shard, labels, counted, valid_rows)``: the autocast
        operands, the int64 (shifted) labels, their ``!= ignore_index`` mask and its indices
        (flattened).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs an initialised torch.distributed process group (the tensor-parallel "
            f"group)"
        )
    hidden, weight_shard, bias_shard = _autocast(hidden, weight_shard, bias_shard)
    _check_tensors(hidden, weight_shard, labels, bias_shard)
    shard = weight_shard.shape[0]
    if vocab_size < 1 or vocab_start < 0 or vocab_start + shard > vocab_size:
        raise ValueError(
            f"the shard [vocab_start, vocab_start + V_r) = [{vocab_start}, {vocab_start + shard}) "
            f"must lie in [0, vocab_size) with vocab_size = {vocab_size} >= 1"
        )
    labels = labels.long()
    if shift:
        labels = _shift(labels, ignore_index)
    flat = labels.reshape(-1)
    counted = flat != ignore_index
    valid_rows = counted.nonzero().squeeze(1)
    bad = flat[counted & ((flat < 0) | (flat >= vocab_size))]
    if check_replicated:
        _check_replicated(group, hidden, flat, valid_rows.shape[0], vocab_start, shard,
                          vocab_size, bad.numel())
    if bad.numel():
        raise LabelOutOfRangeError(
            f"label {bad[0].item()} is outside [0, V) with V = {vocab_size} and is not "
            f"ignore_index = {ignore_index}"
        )
    return hidden, weight_shard, bias_shard, labels, counted, valid_rows


def _shift(labels, ignore_index):
    if labels.dim() < 1:
        raise ValueError("shift=True needs labels with a sequence dimension")
    pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def _scale(reduction, num_items, n_valid, device, dtype):
    """Multiplier of the loss sum: ``1 / num_items_in_batch`` for every value, as stock
    divides (inf for 0, so NaN when nothing is counted; NaN for NaN; negative for negative),
    else ``1 / counted`` for a mean (1 with none counted), else 1."""
    if num_items is not None:
        if isinstance(num_items, torch.Tensor):
            return 1.0 / num_items.detach().reshape(()).to(device=device, dtype=dtype)
        if num_items == 0:
            return math.copysign(math.inf, num_items)
        return 1.0 / float(num_items)
    if reduction == "mean":
        return 1.0 / max(n_valid, 1)
    return 1.0


def _same(values) -> bool:
    first = values[0]
    return all(v == first or (math.isnan(v) and math.isnan(first)) for v in values)


def _check_replicated(group, hidden, labels, n_valid, vocab_start, shard, vocab_size, n_bad):
    """All-gather each rank's fingerprint; raise unless the calls agree and the shards tile V.
    ``n_bad`` (labels out of range) travels with it, so that every rank raises when one rank's
    labels hold one, even where the label checksums of differing labels happen to agree."""
    n = labels.shape[0]
    weights = torch.arange(n, device=labels.device) % 997 + 1  # position-sensitive, < 2**53
    fingerprint = torch.stack([
        torch.tensor(float(n), dtype=torch.float64, device=hidden.device),
        torch.tensor(float(n_valid), dtype=torch.float64, device=hidden.device),
        ((labels + 1) * weights).sum().to(torch.float64),
        hidden.sum(dtype=torch.float64),
        torch.tensor(float(vocab_size), dtype=torch.float64, device=hidden.device),
        torch.tensor(float(vocab_start), dtype=torch.float64, device=hidden.device),
        torch.tensor(float(shard), dtype=torch.float64, device=hidden.device),
        torch.tensor(float(n_bad), dtype=torch.float64, device=hidden.device),
    ])
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(fingerprint) for _ in range(world)]
    dist.all_gather(gathered, fingerprint, group=group)
    rows = torch.stack(gathered).tolist()
    names = ("rows", "counted rows", "labels", "hidden states", "vocab_size")
    for i, name in enumerate(names):
        if not _same([r[i] for r in rows]):
            raise ValueError(
                f"the ranks of the tensor-parallel group disagree on their {name} "
                f"({[r[i] for r in rows]}): every rank must pass the same hidden states, "
                f"labels and vocab_size"
            )
    bounds = sorted((int(r[5]), int(r[5]) + int(r[6])) for r in rows)
    tiled = bounds[0][0] == 0 and bounds[-1][1] == vocab_size and all(
        lo == prev_hi for (lo, _), (_, prev_hi) in zip(bounds[1:], bounds)
    )
    if not tiled:
        raise ValueError(
            f"the ranks' vocabulary shards {bounds} do not tile [0, {vocab_size}) exactly"
        )
    offending = [i for i, r in enumerate(rows) if r[7]]
    if offending and not n_bad:  # that rank raises its own error, naming the label
        raise LabelOutOfRangeError(
            f"rank(s) {offending} of the tensor-parallel group hold a label outside [0, V) with "
            f"V = {vocab_size} that is not ignore_index (and every rank must pass the same "
            f"labels)"
        )

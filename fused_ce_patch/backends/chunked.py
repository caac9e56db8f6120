"""The chunked linear-cross-entropy algorithm, shared by every backend that keeps a bounded
amount of logits in memory (``torch``, and the positive-budget paths of ``triton``/``ascend``).

Rows whose label is ``ignore_index`` are dropped before any matmul (as torchtune's chunked CE
does), then the counted rows are cut into chunks whose transient logits fit ``logits_budget``::

    for each chunk of counted rows:
        z   = h_c @ W.T (+ b)                  one matmul in the input dtype
        dz  = kernel.row_loss_grad_(z, ...)    LSE, loss and dL/dz in one pass over z
        dH[rows] = dz @ W ; dW += dz.T @ h_c ; db += dz.sum(0)

When a single row's logits exceed the budget, each chunk is further cut along the vocabulary
and the log-sum-exp is accumulated with a running maximum (Milakov & Gimelshein, "Online
normalizer calculation for softmax", 2018), then a second pass over the tiles writes dz.

Two schedules:
- *eager* (``reduction="sum"``, grads needed, budget > 0, bfloat16/float32/float64 inputs):
  gradients are computed in the forward pass (3 matmuls in all, as Liger-Kernel's FLCE does)
  and scaled by the upstream gradient in backward;
- *recompute* (``reduction="none"``, float16 inputs, or the backend asked for it): the forward
  keeps only the losses (and, when the vocabulary is tiled, one LSE per counted row); backward
  recomputes the logits and honours the upstream gradient, one per position if need be.

Why float16 recomputes (:func:`forward_grad_safe`): a gradient formed in forward is rounded
to the input dtype at the loss's own scale (``1 / N`` for a mean), before the upstream
gradient is known. float16 has a 5-bit exponent: at that scale most entries of ``dz`` and of
``dH`` are subnormal or zero, and fp16 training multiplies the loss by a large factor (2**16
for ``torch.amp.GradScaler``) precisely so that the gradient is formed at a scale where they
are normal. Multiplying the rounded gradient afterwards rescues nothing (dH error 2e-2 at
scale 2**16 against PyTorch's 3e-4). Recomputing forms ``dz`` at the real upstream scale, as
PyTorch does, for one more matmul (the logits) per chunk. Scaling the forward-time gradient
by a guessed power of two instead would overflow (dW sums over every row that shares a
label) or flush, depending on a scale the forward cannot see. bfloat16 shares float32's
exponent range, so its forward-time gradient keeps its precision at any upstream scale.

Precision: a row's loss is ``(max - z_y) + log(sumexp)``, never ``LSE - z_y`` after rounding
the LSE (which would cost ~1e-4 relative when p(target) ~= 0.999), and whole rows recompute
their max and sum-exp in backward rather than reuse a rounded LSE; see also
:attr:`LogitsKernel.precise_lse` and :attr:`LogitsKernel.tile_dh_fp32` for the tiled path.

The arithmetic on a logits chunk is delegated to a :class:`LogitsKernel` (torch ops for the
``torch`` backend, Triton kernels for ``triton``/``ascend``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..errors import single_backward
from .base import LossSpec, Problem
from .nonfinite_scale import stock_chain_grads


class LogitsKernel:
    """Arithmetic on one chunk of logits. ``z`` is ``[r, v]`` logits including the bias;
    ``y`` the ``[r]`` labels of those rows (all counted, i.e. != ignore_index); per-row
    results are float32 (float64 for float64 inputs).
    """

    #: How dW is accumulated across chunks: "fp32" (a float32 buffer, cast once at the end)
    #: or "output" (added into a buffer of the weight's dtype by each chunk's matmul).
    dw_accumulate: str = "fp32"

    def bytes_per_logit(self, dtype: torch.dtype, spec: LossSpec) -> int:
        """Transient bytes per logit element (the matmul output plus the kernel's buffers)."""
        raise NotImplementedError

    def row_loss(self, z: torch.Tensor, y: torch.Tensor, spec: LossSpec):
        """Full rows (``v == V``): return ``(loss [r], lse [r])``. May overwrite ``z``."""
        raise NotImplementedError

    def row_loss_grad_(self, z, y, spec: LossSpec, scale):
        """Full rows: return ``(loss [r], lse [r], dz [r, V])`` with ``dz = scale * dL/dz``.

        ``scale`` is a Python float or a 0-d / ``[r]`` tensor. ``dz`` may reuse ``z``'s memory.
        """
        raise NotImplementedError

    def tile_stats(self, z, y, v0: int, spec: LossSpec):
        """Vocabulary tile ``[v0, v0 + v)``: return ``(max, sumexp, z_target, z_sum)`` per row,
        where ``sumexp`` is relative to ``max``, ``z_target`` is the (softcapped) target logit if
        it lies in the tile else 0, and ``z_sum`` the sum of (softcapped) logits in the tile."""
        raise NotImplementedError

    def tile_grad_(self, z, y, v0: int, vocab: int, lse, spec: LossSpec, scale):
        """Vocabulary tile: return ``scale * dL/dz`` for the tile given the rows' final LSE
        (float64 when :attr:`precise_lse` is set)."""
        raise NotImplementedError

    #: Whether a vocabulary tile's dH partial is computed in float32 (from a float32 copy of
    #: the weight tile, counted by :meth:`bytes_per_column`) for float16/bfloat16 inputs,
    #: instead of being rounded to the input dtype before the tiles' partials are summed.
    tile_dh_fp32: bool = False

    def bytes_per_column(self, dtype: torch.dtype, hidden_size: int) -> int:
        """Transient bytes per vocabulary column of a tile that do not scale with its rows."""
        return 0

    #: Whether :meth:`tile_grad_` takes the LSE in float64 for float32 work. A float32 LSE of
    #: about 10 is off by up to 5e-7, which is a relative error of 5e-4 in ``p_y - 1`` when
    #: ``p_y ~= 0.999``; ``exp((z - hi) - lo)`` with ``hi + lo = LSE`` keeps it exact.
    precise_lse: bool = False


def finish_loss(lse, z_target, z_sum, vocab: int, spec: LossSpec, nll=None):
    """Per-row loss from the LSE, the target logit and the sum of logits (docs/design.md §1).

    ``nll`` (``lse - z_target``) may be given when computed more precisely, e.g. as
    ``(max - z_target) + log(sumexp)``, which does not round ``lse`` first.
    """
    if nll is None:
        nll = lse - z_target
    loss = nll
    if spec.label_smoothing:
        eps = spec.label_smoothing
        loss = (1.0 - eps) * nll + eps * (lse - z_sum / vocab)
    if spec.z_loss:
        loss = loss + spec.z_loss * lse * lse
    return loss


@dataclass(frozen=True)
class ChunkPlan:
    """Rows per chunk and vocabulary columns per tile (``vocab_tile == V``: whole rows)."""

    rows: int
    vocab_tile: int


def plan_chunks(
    n_rows: int,
    vocab: int,
    bytes_per_logit: int,
    budget: int,
    min_rows: int = 16,
    bytes_per_column: int = 0,
) -> ChunkPlan:
    """Largest chunks whose ``rows * vocab_tile * bytes_per_logit`` fit ``budget`` bytes.

    Whole rows are preferred; the vocabulary is tiled only when fewer than ``min_rows`` whole
    rows (or fewer than ``n_rows`` if that is smaller) would fit. A tile also pays
    ``bytes_per_column`` per column (:meth:`LogitsKernel.bytes_per_column`).
    """
    n_rows = max(n_rows, 1)
    budget = max(int(budget), bytes_per_logit)
    per_row = vocab * bytes_per_logit
    rows = budget // per_row
    if rows >= min(n_rows, min_rows):
        return ChunkPlan(rows=min(rows, n_rows), vocab_tile=vocab)
    rows = max(1, min(n_rows, min_rows, budget // bytes_per_logit))
    tile = max(1, min(vocab, budget // (rows * bytes_per_logit + bytes_per_column)))
    return ChunkPlan(rows=rows, vocab_tile=tile)


class RowSource:
    """Reads rows of ``hidden [..., H]`` by flat index without copying a non-contiguous input
    whole (e.g. ``hidden[:, -k:, :]``)."""

    def __init__(self, hidden: torch.Tensor):
        self.lead_shape = hidden.shape[:-1]
        try:
            self.flat = hidden.view(-1, hidden.shape[-1])
            self.nd = None
        except RuntimeError:
            self.flat = None
            self.nd = hidden

    def take(self, idx: torch.Tensor) -> torch.Tensor:
        """``[len(idx), H]`` rows, contiguous."""
        if self.flat is not None:
            return self.flat.index_select(0, idx)
        return self.nd[torch.unravel_index(idx, self.lead_shape)].contiguous()


@dataclass
class ChunkConfig:
    """Non-tensor arguments of :class:`ChunkedLinearCrossEntropy`."""

    kernel: LogitsKernel
    spec: LossSpec
    plan: ChunkPlan
    reduction: str  # "none" | "sum"
    scale: float | torch.Tensor
    n_valid: int
    eager: bool
    need: tuple[bool, bool, bool] = field(default=(False, False, False))


@dataclass
class _Grads:
    dh: torch.Tensor | None
    dw: torch.Tensor | None
    db: torch.Tensor | None


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logits(h, weight, bias, v0: int, v1: int) -> torch.Tensor:
    """``[r, v1 - v0]`` logits of rows ``h`` for the vocabulary slice ``[v0, v1)``."""
    if v0 == 0 and v1 == weight.shape[0]:
        w, b = weight, bias
    else:
        w, b = weight[v0:v1], None if bias is None else bias[v0:v1]
    if b is None:
        return torch.mm(h, w.t())
    return torch.addmm(b, h, w.t())


class _Runner:
    """One pass over the chunks, shared by forward (stats or eager grads) and backward."""

    def __init__(self, hidden, weight, bias, labels, valid_rows, cfg: ChunkConfig):
        self.rows = RowSource(hidden)
        self.weight, self.bias, self.labels, self.valid_rows = weight, bias, labels, valid_rows
        self.cfg = cfg
        self.vocab = weight.shape[0]
        self.acc = _loss_dtype(weight.dtype)

    def logits(self, h, v0, v1):
        return _logits(h, self.weight, self.bias, v0, v1)

    def chunks(self):
        step = self.cfg.plan.rows
        # Every row counted and hidden viewable as [N, H]: chunks are views, not copies.
        dense = self.cfg.n_valid == self.labels.shape[0] and self.rows.flat is not None
        for start in range(0, self.cfg.n_valid, step):
            end = min(start + step, self.cfg.n_valid)
            idx = self.valid_rows[start:end]
            if dense:
                yield start, idx, self.rows.flat[start:end], self.labels[start:end]
            else:
                yield start, idx, self.rows.take(idx), self.labels.index_select(0, idx)

    def tiles(self):
        tile = self.cfg.plan.vocab_tile
        for v0 in range(0, self.vocab, tile):
            yield v0, min(v0 + tile, self.vocab)

    @property
    def whole_rows(self) -> bool:
        return self.cfg.plan.vocab_tile >= self.vocab

    def new_grads(self, hidden_shape, dtype, device) -> _Grads:
        need_h, need_w, need_b = self.cfg.need
        n, hsize = self.rows.lead_shape.numel(), self.weight.shape[1]
        dw_dtype = self.acc if self.cfg.kernel.dw_accumulate == "fp32" else self.weight.dtype
        return _Grads(
            dh=torch.zeros(n, hsize, dtype=dtype, device=device) if need_h else None,
            dw=torch.zeros(self.weight.shape, dtype=dw_dtype, device=device) if need_w else None,
            db=torch.zeros(self.vocab, dtype=self.acc, device=device)
            if (need_b and self.bias is not None)
            else None,
        )

    def backprop(self, dz, h, idx, v0, v1, grads: _Grads, dh_rows):
        """Add one tile's ``dz`` into the gradients; ``dh_rows`` accumulates across tiles."""
        if grads.dh is not None:
            w = self.weight if self.whole_rows else self.weight[v0:v1]
            if dh_rows is None:
                part = torch.mm(dz if dz.dtype == w.dtype else dz.to(w.dtype), w)
                grads.dh.index_copy_(0, idx, part.to(grads.dh.dtype))
            elif self.cfg.kernel.tile_dh_fp32 and w.dtype != dh_rows.dtype:
                dh_rows.addmm_(dz.to(dh_rows.dtype), w.to(dh_rows.dtype))
            else:
                dh_rows += torch.mm(dz if dz.dtype == w.dtype else dz.to(w.dtype), w)
        if grads.dw is not None:
            dw = grads.dw[v0:v1]
            a = dz.t() if dz.dtype == dw.dtype else dz.t().to(dw.dtype)
            dw.addmm_(a, h if h.dtype == dw.dtype else h.to(dw.dtype))
        if grads.db is not None:
            grads.db[v0:v1] += dz.sum(0, dtype=grads.db.dtype)

    def stats(self, h, y):
        """Per-row ``(loss, lse)`` of one chunk over vocabulary tiles (no gradient)."""
        kernel, spec = self.cfg.kernel, self.cfg.spec
        if self.whole_rows:
            return kernel.row_loss(self.logits(h, 0, self.vocab), y, spec)
        m = se = z_t = z_s = None
        for v0, v1 in self.tiles():
            tm, tse, tzt, tzs = kernel.tile_stats(self.logits(h, v0, v1), y, v0, spec)
            if m is None:
                m, se, z_t, z_s = tm, tse, tzt, tzs
                continue
            new_m = torch.maximum(m, tm)
            se = se * torch.exp(m - new_m) + tse * torch.exp(tm - new_m)
            m, z_t, z_s = new_m, z_t + tzt, z_s + tzs
        log_se = torch.log(se)
        lse = m + log_se
        loss = finish_loss(lse, z_t, z_s, self.vocab, spec, nll=(m - z_t) + log_se)
        if kernel.precise_lse and lse.dtype == torch.float32:
            lse = m.double() + log_se.double()
        return loss, lse

    def eager_chunk(self, h, y, idx, grads: _Grads):
        """Loss of one chunk, adding ``cfg.scale * dL/d(inputs)`` into ``grads``."""
        cfg = self.cfg
        if self.whole_rows:
            z = self.logits(h, 0, self.vocab)
            loss, _, dz = cfg.kernel.row_loss_grad_(z, y, cfg.spec, cfg.scale)
            del z  # may be dz's storage; drop the name so only dz keeps it
            self.backprop(dz, h, idx, 0, self.vocab, grads, None)
            return loss
        loss, lse = self.stats(h, y)
        self.grads_from_lse(h, y, idx, lse, cfg.scale, grads)
        return loss

    def grads_recompute(self, h, y, idx, lse, scale, grads: _Grads):
        """Backward of one chunk: recompute its logits and add ``scale * dL/d(inputs)``.

        Whole rows redo the forward's own arithmetic (max and sum-exp of the row, so
        ``p_y - 1`` is as exact as in the eager schedule; ``lse`` is unused); tiles use the
        saved ``lse``."""
        if self.whole_rows:
            z = self.logits(h, 0, self.vocab)
            _, _, dz = self.cfg.kernel.row_loss_grad_(z, y, self.cfg.spec, scale)
            del z
            self.backprop(dz, h, idx, 0, self.vocab, grads, None)
        else:
            self.grads_from_lse(h, y, idx, lse, scale, grads)

    def grads_from_lse(self, h, y, idx, lse, scale, grads: _Grads):
        """Second pass over the tiles of one chunk: ``dz`` from the known LSE, then backprop."""
        dh_rows = None
        if grads.dh is not None and not self.whole_rows:
            dh_rows = torch.zeros(h.shape, dtype=self.acc, device=h.device)
        for v0, v1 in self.tiles():
            z = self.logits(h, v0, v1)
            dz = self.cfg.kernel.tile_grad_(z, y, v0, self.vocab, lse, self.cfg.spec, scale)
            self.backprop(dz, h, idx, v0, v1, grads, dh_rows)
        if dh_rows is not None:
            grads.dh.index_copy_(0, idx, dh_rows.to(grads.dh.dtype))


def _finalize(grads: _Grads, hidden, weight, bias):
    dh = None if grads.dh is None else grads.dh.view(hidden.shape)
    dw = None if grads.dw is None else grads.dw.to(weight.dtype)
    db = None if grads.db is None else grads.db.to(bias.dtype)
    return dh, dw, db


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``apply(hidden, weight, bias, labels, valid_rows, cfg)`` → ``[N]`` losses or 0-d sum.

    See the module docstring for the algorithm.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid_rows, cfg: ChunkConfig):
        run = _Runner(hidden, weight, bias, labels, valid_rows, cfg)
        acc = run.acc
        device = hidden.device
        per_row = (
            torch.zeros(labels.shape[0], dtype=acc, device=device)
            if cfg.reduction == "none"
            else None
        )
        total = torch.zeros((), dtype=acc, device=device)
        lse_all = None  # needed by the recompute schedule over vocabulary tiles only
        if not cfg.eager and not run.whole_rows:
            lse_dtype = torch.float64 if cfg.kernel.precise_lse else acc
            lse_all = torch.empty(cfg.n_valid, dtype=lse_dtype, device=device)
        grads = run.new_grads(hidden.shape, hidden.dtype, device) if cfg.eager else None

        for start, idx, h, y in run.chunks():
            if cfg.eager:
                loss = run.eager_chunk(h, y, idx, grads)
            else:
                loss, lse = run.stats(h, y)
                if lse_all is not None:
                    lse_all[start : start + idx.shape[0]] = lse
            if per_row is not None:
                per_row.index_copy_(0, idx, loss.to(acc))
            else:
                total += loss.sum(dtype=acc)

        ctx.cfg = cfg
        # labels and valid_rows are small integer vectors; keeping them lets a second backward
        # through a retained graph replay the eager pass.
        ctx.save_for_backward(hidden, weight, bias, labels, valid_rows, lse_all)
        ctx.grads = grads
        if per_row is not None:
            return per_row
        return total * cfg.scale

    @staticmethod
    @single_backward
    def backward(ctx, grad_out):
        cfg: ChunkConfig = ctx.cfg
        if cfg.reduction != "none" and _batched(grad_out):
            # torch.autograd.grad(..., is_grads_batched=True) (vmap over the upstream
            # gradient): the gradient is linear in it, so the unit gradient is formed as
            # usual and scaled out of place (in-place updates of unbatched buffers by a
            # batched value are not allowed).
            unit = _backward(ctx, torch.ones((), dtype=torch.float32,
                                             device=ctx.saved_tensors[0].device))
            return tuple(None if g is None else (g * grad_out).to(g.dtype) for g in unit)
        if cfg.reduction != "none" and not bool(torch.isfinite(grad_out).all()):
            # an inf/NaN upstream gradient: stock's chain gives NaN where s * (p - onehot)
            # would give +-inf (log-softmax backward forms -s + p_y s at the target)
            hidden, weight, bias, labels, valid_rows, _ = ctx.saved_tensors
            acc = _loss_dtype(weight.dtype)
            s = grad_out.detach().to(acc) * cfg.scale
            ctx.grads = None
            return (*stock_chain_grads(hidden, weight, bias, labels, valid_rows, cfg.n_valid,
                                       cfg.spec, s, ctx.needs_input_grad[:3]),
                    None, None, None)
        return _backward(ctx, grad_out)


def _batched(t) -> bool:
    """Whether ``t`` is a batched tensor: ``torch.autograd.grad(..., is_grads_batched=True)``
    runs backward under the legacy vmap (``is_legacy_batchedtensor``), ``torch.func.vmap``
    under functorch's (``is_batchedtensor``)."""
    functorch = getattr(torch._C, "_functorch", None)
    if not isinstance(t, torch.Tensor) or functorch is None:
        return False
    return any(bool(getattr(functorch, name)(t)) for name in
               ("is_legacy_batchedtensor", "is_batchedtensor") if hasattr(functorch, name))


def _backward(ctx, grad_out):
    """The gradients for ``grad_out``: the eager ones scaled, or recomputed."""
    cfg: ChunkConfig = ctx.cfg
    hidden, weight, bias, labels, valid_rows, lse_all = ctx.saved_tensors
    if cfg.eager:
        grads = ctx.grads
        # Handed to autograd (which may adopt the buffers as .grad without a copy); a
        # second backward through a retained graph replays the same eager pass, so the
        # result is bitwise the same.
        ctx.grads = None
        if grads is None:
            run = _Runner(hidden, weight, bias, labels, valid_rows, cfg)
            grads = run.new_grads(hidden.shape, hidden.dtype, hidden.device)
            for _, idx, h, y in run.chunks():
                run.eager_chunk(h, y, idx, grads)
        g = grad_out.item()  # a Python float keeps the scale out of bf16 rounding
        if g != 1.0:
            for t in (grads.dh, grads.dw, grads.db):
                if t is not None:
                    t.mul_(g)
        return (*_finalize(grads, hidden, weight, bias), None, None, None)

    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    cfg_b = replace(cfg, need=(need_h, need_w, need_b))
    run = _Runner(hidden, weight, bias, labels, valid_rows, cfg_b)
    grads = run.new_grads(hidden.shape, hidden.dtype, hidden.device)
    if cfg.reduction == "none":
        row_scale = grad_out.reshape(-1).to(run.acc)
    else:
        row_scale = None
        scale = grad_out.to(run.acc) * cfg.scale
    for start, idx, h, y in run.chunks():
        lse = None if lse_all is None else lse_all[start : start + idx.shape[0]]
        s = row_scale.index_select(0, idx) if row_scale is not None else scale
        run.grads_recompute(h, y, idx, lse, s, grads)
    return (*_finalize(grads, hidden, weight, bias), None, None, None)


def forward_grad_safe(dtype: torch.dtype) -> bool:
    """Whether a gradient formed in forward (at the loss's own scale, rounded to ``dtype``)
    keeps its precision once backward multiplies it by any upstream gradient: true for
    dtypes with float32's exponent range (bfloat16, float32, float64), false for float16
    (module docstring)."""
    return dtype != torch.float16


def run_chunked(problem: Problem, kernel: LogitsKernel, budget: int, eager: bool = True):
    """Run ``problem`` with the chunked algorithm under ``budget`` bytes of transient logits.

    ``eager=False`` forces the recompute schedule (logits recomputed in backward); float16
    inputs always take it (:func:`forward_grad_safe`).
    """
    hidden, weight, bias = problem.hidden, problem.weight, problem.bias
    grad_on = torch.is_grad_enabled()
    need = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    plan = plan_chunks(
        problem.n_valid,
        problem.vocab_size,
        kernel.bytes_per_logit(hidden.dtype, problem.spec),
        budget,
        bytes_per_column=kernel.bytes_per_column(hidden.dtype, problem.hidden_size),
    )
    cfg = ChunkConfig(
        kernel=kernel,
        spec=problem.spec,
        plan=plan,
        reduction=problem.reduction,
        scale=problem.scale,
        n_valid=problem.n_valid,
        eager=eager
        and problem.reduction == "sum"
        and any(need)
        and forward_grad_safe(hidden.dtype),
        need=need,
    )
    return ChunkedLinearCrossEntropy.apply(
        hidden, weight, bias, problem.labels, problem.valid_rows, cfg
    )

"""Chunked generalized Jensen-Shannon divergence from two models' hidden states.

Algorithm (docs/usage.md, "Distillation"): the counted rows (label != ``ignore_index``) are cut
into chunks whose transient logits of *both* models fit ``logits_budget``; per chunk::

    xs = hs_c @ Ws.T (+ bs) ; xt = ht_c @ Wt.T (+ bt)    matmuls with float32 outputs
    D, H, dxs, dxt = row_kernel(xs, xt)                   float32, per row, in place
    dHs[rows] = dxs @ Ws ; dWs += dxs.T @ hs_c ; dbs += dxs.sum(0)     (teacher alike)

Whole rows only (one row of each model at least, whatever the budget); neither ``[N, V]``
logits tensor exists at any point. The row arithmetic is a :class:`TorchDivergenceKernel`
(torch ops, any device) or a :class:`TritonDivergenceKernel`
(:mod:`.triton.distill_kernels`, CUDA), chosen by :func:`select_kernel`.

Schedules, as the chunked cross-entropy's (:mod:`.chunked`): scalar results with gradients
form them in forward, at the reduction's scale (``1 / count``: one rounding of dH and dW when
``loss.backward()`` brings an upstream gradient of 1; another is multiplied in backward), 3
matmuls per model; per-token results (``reduction="none"``) and float16 inputs recompute the
logits in backward and form the gradient at each row's upstream gradient
(:func:`.chunked.forward_grad_safe`). dW sums the chunks in float32 and rounds once, except
for 16-bit weights on CUDA, where cuBLAS adds each chunk into the weight-dtype gradient (no
float32 ``[V, H]`` buffer: 1 GiB at a 128k x 2048 head).

Per row, with ``z = softcap(scale * x) / T`` (``softcap(y) = c tanh(y / c)`` or identity),
``ls = log_softmax(z_s)``, ``lt = log_softmax(z_t)``, ``p = exp(l)``:

- beta 0 (forward KL, TRL's ``kl_div(ls, lt, log_target=True)``): ``D = sum p_t (lt - ls)``;
  ``dD/dz_s = p_s - p_t``; ``dD/dz_t = p_t (lt - ls - D)``.
- beta 1 (reverse KL): ``D = sum p_s (ls - lt)``; ``dD/dz_s = p_s (ls - lt - D)``;
  ``dD/dz_t = p_t - p_s``.
- 0 < beta < 1: ``m = (1 - beta) p_s + beta p_t`` (``log m`` by logaddexp),
  ``KLs = sum p_s (ls - log m)``, ``KLt = sum p_t (lt - log m)``,
  ``D = beta KLt + (1 - beta) KLs``. As ``D = beta sum p_t lt + (1 - beta) sum p_s ls -
  sum m log m``, ``dD/dp_s = (1 - beta)(ls - log m)`` (the ``+1`` terms cancel), and through
  the softmax Jacobian ``dD/dz_s = (1 - beta) p_s (ls - log m - KLs)``; likewise
  ``dD/dz_t = beta p_t (lt - log m - KLt)``.
- student entropy ``-sum p_s ls`` (no gradient).

Chain rule to the raw logits: ``dz/dx = scale * (1 - tanh^2(scale x / c)) / T``.

Source: Agarwal et al., "On-Policy Distillation of Language Models" (GKD, 2024), Eq. 1; the
conventions (which KL is "forward", the mixture, the reductions) are TRL 1.16's
``GKDTrainer.generalized_jsd_loss``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from ..errors import BackendUnavailableError, single_backward
from .chunked import RowSource, forward_grad_safe, plan_chunks
from .registry import ENV_VAR

#: Default budget (bytes) of one chunk's transient logits of both models on the CPU and other
#: devices without Triton (the chunked cross-entropy's CPU default).
DEFAULT_BUDGET = 192 * 2**20
#: Default budget on CUDA: with the float32 work of both models counted, a few hundred rows of
#: a 128k vocabulary (large enough for cuBLAS to run near full speed).
DEFAULT_BUDGET_CUDA = 384 * 2**20

_LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class DivergenceSpec:
    """The per-row divergence, independent of how it is computed.

    Attributes:
        beta: mixture weight in ``[0, 1]`` (0 forward KL, 1 reverse KL).
        temperature: divides both models' (scaled, softcapped) logits; > 0.
        student_scale, teacher_scale: multiply the raw logits first (1.0: none).
        student_softcap, teacher_softcap: ``c`` of ``c * tanh(y / c)`` after the scale, or None.
    """

    beta: float = 0.5
    temperature: float = 1.0
    student_scale: float = 1.0
    teacher_scale: float = 1.0
    student_softcap: float | None = None
    teacher_softcap: float | None = None


def _transform_(x: torch.Tensor, scale: float, softcap: float | None, inv_t: float):
    """``x`` (float32, in place) to ``softcap(scale * x) / T``; returns ``dz/dx`` per element
    as a tensor, or the Python float it is when no softcap."""
    if scale != 1.0:
        x.mul_(scale)
    slope: float | torch.Tensor = scale * inv_t
    if softcap is not None:
        x.div_(softcap).tanh_()
        slope = (1.0 - x * x).mul_(scale * inv_t)
        x.mul_(softcap)
    if inv_t != 1.0:
        x.mul_(inv_t)
    return slope


def _log_softmax_(z: torch.Tensor) -> torch.Tensor:
    # (z - max) - log(sum exp(z - max)), not z - LSE: a common offset of the logits cancels
    # exactly in the first difference, where LSE would be rounded at the offset's magnitude
    z.sub_(z.amax(dim=1, keepdim=True))
    return z.sub_(z.exp().sum(dim=1, keepdim=True).log_())


def divergence_rows_(xs, xt, spec: DivergenceSpec, need_s: bool, need_t: bool,
                     want_entropy: bool):
    """Per-row divergence of one chunk of raw float32 logits, in torch ops.

    Args:
        xs, xt: ``[r, V]`` float32 raw logits (bias included) of student and teacher;
            overwritten.
        spec: the divergence.
        need_s, need_t: whether ``dD/dxs`` / ``dD/dxt`` are wanted.
        want_entropy: whether to compute the student entropy.

    Returns:
        ``(D [r], entropy [r] or None, dxs [r, V] or None, dxt [r, V] or None)``, float32;
        the gradients are of ``D`` itself (upstream weight 1) and may reuse ``xs``/``xt``.
    """
    inv_t = 1.0 / spec.temperature
    slope_s = _transform_(xs, spec.student_scale, spec.student_softcap, inv_t)
    slope_t = _transform_(xt, spec.teacher_scale, spec.teacher_softcap, inv_t)
    ls, lt = _log_softmax_(xs), _log_softmax_(xt)
    ps, pt = ls.exp(), lt.exp()
    entropy = -(ps * ls).sum(1) if want_entropy else None
    beta = spec.beta
    gs = gt = None
    if beta == 0.0:
        diff = lt - ls
        d = (pt * diff).sum(1)
        if need_t:
            gt = diff.sub_(d.unsqueeze(1)).mul_(pt)
        if need_s:
            gs = ps.sub_(pt)
    elif beta == 1.0:
        diff = ls - lt
        d = (ps * diff).sum(1)
        if need_s:
            gs = diff.sub_(d.unsqueeze(1)).mul_(ps)
        if need_t:
            gt = pt.sub_(ps)
    else:
        log_m = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
        ks = ls.sub_(log_m).mul_(ps)  # p_s (ls - log m)
        kt = lt.sub_(log_m).mul_(pt)
        del log_m
        kl_s, kl_t = ks.sum(1), kt.sum(1)
        d = beta * kl_t + (1.0 - beta) * kl_s
        if need_s:
            gs = ks.sub_(ps.mul_(kl_s.unsqueeze(1))).mul_(1.0 - beta)
        if need_t:
            gt = kt.sub_(pt.mul_(kl_t.unsqueeze(1))).mul_(beta)
    if gs is not None:
        gs = gs.mul_(slope_s)
    if gt is not None:
        gt = gt.mul_(slope_t)
    return d, entropy, gs, gt


#: float32 ``[r, V]`` tensors the torch row arithmetic holds at its peak at the least (both
#: models' logits, both probabilities, a difference, and temporaries of the in-place updates);
#: :meth:`TorchDivergenceKernel.bytes_per_column` adds what the options cost.
TORCH_WORK_TENSORS = 7


class TorchDivergenceKernel:
    """Row arithmetic of a chunk in torch ops (:func:`divergence_rows_`); any device."""

    name = "torch"

    def bytes_per_column(self, s_dtype, t_dtype, spec: DivergenceSpec, need_t: bool) -> int:
        """Transient bytes per vocabulary column of one row (both models), at the peak of
        forward + backward (measured per option by tests/test_distill.py)."""
        work = TORCH_WORK_TENSORS
        work += 0.0 < spec.beta < 1.0  # the mixture's log
        work += need_t  # the teacher's gradient beside the student's
        work += (spec.student_softcap is not None) + (spec.teacher_softcap is not None)
        low = sum(2 for d in (s_dtype, t_dtype) if d in _LOW)  # 16-bit copies of dx for dH/dW
        wide = 8 if torch.float64 in (s_dtype, t_dtype) else 4
        return wide * work + low

    def rows_(self, xs, xt, spec, need_s, need_t, want_entropy, row_scale, s_dtype, t_dtype):
        """``(D, entropy, gs, gt)`` of one chunk (:func:`divergence_rows_`), the gradients
        multiplied by ``row_scale`` (``[r]`` float32, or None)."""
        d, ent, gs, gt = divergence_rows_(xs, xt, spec, need_s, need_t, want_entropy)
        if row_scale is not None:
            s = row_scale.unsqueeze(1)
            gs = None if gs is None else gs.mul_(s)
            gt = None if gt is None else gt.mul_(s)
        return d, ent, gs, gt


class TritonDivergenceKernel:
    """Row arithmetic of a chunk in one Triton kernel
    (:mod:`fused_ce_patch.backends.triton.distill_kernels`): float32 logits read three
    times, gradients written once in the dtype the matmuls take."""

    name = "triton"

    def bytes_per_column(self, s_dtype, t_dtype, spec: DivergenceSpec, need_t: bool) -> int:
        """Both models' float32 logits, and the 16-bit gradient buffers."""
        low = sum(2 for d in (s_dtype, t_dtype) if d in _LOW)
        return 8 + low

    def rows_(self, xs, xt, spec, need_s, need_t, want_entropy, row_scale, s_dtype, t_dtype):
        from .triton.distill_kernels import divergence_rows_inplace

        return divergence_rows_inplace(
            xs, xt, spec, need_s, need_t, want_entropy, row_scale,
            s_dtype if s_dtype in _LOW else torch.float32,
            t_dtype if t_dtype in _LOW else torch.float32)


#: Row kernels by name (``backend=`` of :func:`fused_ce_patch.fused_linear_jsd`).
KERNELS = {"torch": TorchDivergenceKernel, "triton": TritonDivergenceKernel}
BACKENDS = ("auto", *KERNELS)


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32: 16-bit operands' products summed in float32 with an unrounded
    float32 result (cuBLAS ``out_dtype`` on CUDA; exactly widened operands elsewhere)."""
    if a.dtype not in _LOW:
        return torch.mm(a, b).float() if a.dtype != torch.float64 else torch.mm(a, b)
    if a.device.type == "cuda":
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # torch without mm.dtype
            pass
    return torch.mm(a.float(), b.float())


def _logits32(h, w, b) -> torch.Tensor:
    x = _mm32(h, w.t())
    if b is not None:
        x.add_(b.to(x.dtype))
    return x


@dataclass
class DistillConfig:
    """Non-tensor arguments of :class:`ChunkedDivergence`."""

    kernel: TorchDivergenceKernel
    spec: DivergenceSpec
    rows: int  # counted rows per chunk
    n_valid: int
    per_row: bool  # True: [N] divergences; False: scale * their sum (0-d)
    want_entropy: bool
    #: multiplier of the sum (a float, or a 0-d float32 tensor on the device); folded into
    #: the gradient formed in forward, so that a backward with upstream gradient 1 (the
    #: usual ``loss.backward()``) rounds each gradient once.
    scale: float | torch.Tensor = 1.0
    need: tuple = field(default=(False,) * 6)  # hs, ws, bs, ht, wt, bt


class _Model:
    """One model's side of a chunk: rows, logits and gradient accumulation."""

    def __init__(self, hidden, weight, bias, need):
        self.rows = RowSource(hidden)
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.need_h, self.need_w, self.need_b = need
        self.need_any = self.need_h or self.need_w or self.need_b
        self.acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        self.dh = self.dw = self.db = None

    def alloc(self):
        n, dev = self.rows.lead_shape.numel(), self.hidden.device
        if self.need_h:
            self.dh = torch.zeros(n, self.weight.shape[1], dtype=self.hidden.dtype, device=dev)
        if self.need_w:
            # float32 sums across chunks (one rounding at the end); CUDA 16-bit weights add
            # each chunk into a weight-dtype buffer instead (cuBLAS reads it in float32), which
            # keeps the extra memory off a float32 [V, H] copy.
            dtype = self.weight.dtype if self._dw_in_weight_dtype() else self.acc
            self.dw = torch.zeros(self.weight.shape, dtype=dtype, device=dev)
        if self.need_b and self.bias is not None:
            self.db = torch.zeros(self.bias.shape, dtype=self.acc, device=dev)

    def _dw_in_weight_dtype(self) -> bool:
        return self.weight.dtype in _LOW and self.weight.device.type == "cuda"

    def take(self, idx, dense, start, end):
        if dense:
            return self.rows.flat[start:end]
        return self.rows.take(idx)

    def backprop(self, dx, h, idx):
        """Add ``dx`` (float32 ``[r, V]``, already scaled) into this model's gradients."""
        low = dx if self.weight.dtype == dx.dtype else dx.to(self.weight.dtype)
        if self.dh is not None:
            self.dh.index_copy_(0, idx, _mm32(low, self.weight).to(self.dh.dtype))
        if self.dw is not None:
            if self.dw.dtype == self.weight.dtype:
                self.dw.addmm_(low.t(), h)
            else:
                self.dw.add_(_mm32(low.t(), h))
        if self.db is not None:
            self.db += dx.sum(0, dtype=self.db.dtype)

    def finish(self, g):
        dh = None if self.dh is None else self.dh.view(self.hidden.shape)
        dw = None if self.dw is None else self.dw
        db = None if self.db is None else self.db
        if g is not None:
            for t in (dh, dw, db):
                if t is not None:
                    t.mul_(g)
        if dw is not None:
            dw = dw.to(self.weight.dtype)
        if db is not None:
            db = db.to(self.bias.dtype)
        return dh, dw, db


def _passes(student: _Model, teacher: _Model, valid_rows, cfg: DistillConfig, row_scale,
            d_out, ent_out, grads: bool):
    """One pass over the chunks: divergences into ``d_out`` (per row or a 0-d sum), entropies
    into ``ent_out``, and with ``grads`` each row's ``row_scale * dD`` into both models."""
    n_total = student.rows.lead_shape.numel()
    dense = (cfg.n_valid == n_total and student.rows.flat is not None
             and teacher.rows.flat is not None)
    need_s = grads and student.need_any
    need_t = grads and teacher.need_any
    for start in range(0, cfg.n_valid, cfg.rows):
        end = min(start + cfg.rows, cfg.n_valid)
        idx = valid_rows[start:end]
        hs = student.take(idx, dense, start, end)
        ht = teacher.take(idx, dense, start, end)
        xs = _logits32(hs, student.weight, student.bias)
        xt = _logits32(ht, teacher.weight, teacher.bias)
        rs = None if row_scale is None else row_scale[start:end]
        d, ent, gs, gt = cfg.kernel.rows_(xs, xt, cfg.spec, need_s, need_t,
                                          ent_out is not None, rs, hs.dtype, ht.dtype)
        del xs, xt
        if d_out is not None:
            if d_out.dim() == 0:
                d_out += d.sum(dtype=d_out.dtype)
            else:
                d_out.index_copy_(0, idx, d.to(d_out.dtype))
        if ent_out is not None:
            ent_out.index_copy_(0, idx, ent.to(ent_out.dtype))
        if gs is not None:
            student.backprop(gs, hs, idx)
        if gt is not None:
            teacher.backprop(gt, ht, idx)


def _rows_scale(scale, n: int, device, dtype):
    """``scale`` (float or 0-d tensor) as a ``[n]`` tensor of ``dtype`` (the row arithmetic's,
    float32 or float64); None for the float 1."""
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=dtype).reshape(()).expand(n).contiguous()
    if scale == 1.0:
        return None
    return torch.full((n,), scale, dtype=dtype, device=device)


class ChunkedDivergence(torch.autograd.Function):
    """``apply(hs, ws, bs, ht, wt, bt, valid_rows, cfg)`` → ``(D, entropy)``.

    ``D``: ``[N]`` float32 divergences (0 at rows not in ``valid_rows``) when ``cfg.per_row``,
    else ``cfg.scale`` times their sum (0-d). ``entropy``: ``[N]`` float32 student entropies
    (0 at uncounted rows; no gradient), or an empty tensor when not asked for.
    """

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, valid_rows, cfg: DistillConfig):
        student = _Model(hs, ws, bs, cfg.need[:3])
        teacher = _Model(ht, wt, bt, cfg.need[3:])
        n = student.rows.lead_shape.numel()
        dev = hs.device
        acc = torch.float64 if torch.float64 in (ws.dtype, wt.dtype) else torch.float32
        d_out = torch.zeros(n if cfg.per_row else (), dtype=acc, device=dev)
        ent_out = torch.zeros(n, dtype=acc, device=dev) if cfg.want_entropy else None
        # float16 forms its gradient in backward, at the upstream scale (chunked.forward_grad_safe)
        eager = (not cfg.per_row and any(cfg.need)
                 and all(forward_grad_safe(t.dtype) for t in (hs, ht)))
        if eager:
            student.alloc()
            teacher.alloc()
        row_scale = _rows_scale(cfg.scale, valid_rows.shape[0], dev, acc) if eager else None
        _passes(student, teacher, valid_rows, cfg, row_scale, d_out, ent_out, grads=eager)
        if not cfg.per_row:
            d_out = d_out * cfg.scale
        ctx.cfg = cfg
        ctx.eager = eager
        ctx.models = (student, teacher) if eager else None
        ctx.save_for_backward(hs, ws, bs, ht, wt, bt, valid_rows)
        entropy = ent_out if ent_out is not None else torch.empty(0, dtype=acc, device=dev)
        ctx.mark_non_differentiable(entropy)
        return d_out, entropy

    @staticmethod
    @single_backward(what="fused_linear_jsd", remedy="compute the divergence from materialised "
                     "logits (e.g. TRL's GKDTrainer.generalized_jsd_loss)")
    def backward(ctx, grad_d, _grad_entropy):
        cfg: DistillConfig = ctx.cfg
        hs, ws, bs, ht, wt, bt, valid_rows = ctx.saved_tensors
        if grad_d is None:
            return (None,) * 8
        if ctx.eager and ctx.models is not None:
            student, teacher = ctx.models
            ctx.models = None
            g = grad_d.item()  # a Python float: the scale is not rounded to a 16-bit dtype
            g = None if g == 1.0 else g
            return (*student.finish(g), *teacher.finish(g), None, None)
        acc = torch.float64 if torch.float64 in (ws.dtype, wt.dtype) else torch.float32
        student = _Model(hs, ws, bs, ctx.needs_input_grad[:3])
        teacher = _Model(ht, wt, bt, ctx.needs_input_grad[3:6])
        student.alloc()
        teacher.alloc()
        if cfg.per_row:
            row_scale = grad_d.reshape(-1).to(acc).index_select(0, valid_rows)
        else:  # float16, or a second backward through a retained graph
            row_scale = _rows_scale(grad_d.to(acc) * cfg.scale, valid_rows.shape[0], hs.device,
                                    acc)
        _passes(student, teacher, valid_rows, cfg, row_scale, None, None, grads=True)
        return (*student.finish(None), *teacher.finish(None), None, None)


def chunk_rows(n_valid: int, vocab: int, bytes_per_column: int, budget: int) -> int:
    """Rows per chunk: as many whole rows as ``budget`` holds (at least one), the chunks of
    (nearly) equal size so the last is not a sliver."""
    plan = plan_chunks(max(n_valid, 1), vocab, bytes_per_column, budget, min_rows=1)
    rows_max = plan.rows if plan.vocab_tile >= vocab else 1
    chunks = max(1, -(-max(n_valid, 1) // rows_max))
    return max(1, -(-max(n_valid, 1) // chunks))


def default_budget(device: torch.device) -> int:
    return DEFAULT_BUDGET_CUDA if device.type == "cuda" else DEFAULT_BUDGET


def _triton_ok(device: torch.device) -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    if device.type == "cuda":
        return True, ""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True, ""
    return False, f"Triton runs CUDA tensors (CPU ones under TRITON_INTERPRET=1), not {device.type}"


#: The CE backends' environment variable (:data:`.registry.ENV_VAR`): read by ``"auto"`` here
#: too, so ``FUSED_CE_BACKEND=torch`` rules Triton out for the divergence as for the loss.
_ENV_KERNEL = {"triton": "triton", "torch": "torch", "reference": "torch", "ascend": "torch"}


def select_kernel(device: torch.device, dtypes, name: str = "auto"):
    """The row kernel for a call: ``"auto"`` honours ``$FUSED_CE_BACKEND`` (``triton``, or
    ``torch`` / ``reference`` / ``ascend``: the torch ops), else takes Triton on CUDA where it
    imports (float64 calls excepted: the torch ops are as good there) and the torch ops
    elsewhere (CPU, NPU, MPS).

    Raises:
        BackendUnavailableError: ``"triton"`` (asked for, or through the environment) where
            Triton cannot run the call.
        ValueError: an unknown name in ``$FUSED_CE_BACKEND``.
    """
    if name == "auto":
        env = os.environ.get(ENV_VAR, "").strip()
        if env and env != "auto":
            if env not in _ENV_KERNEL:
                raise ValueError(f"${ENV_VAR}={env!r} is not a backend the divergence knows; "
                                 f"valid: auto, {', '.join(_ENV_KERNEL)}")
            name = _ENV_KERNEL[env]
    if name == "torch":
        return TorchDivergenceKernel()
    ok, why = _triton_ok(device)
    if name == "triton":
        if not ok:
            raise BackendUnavailableError(f"backend='triton' cannot run this call: {why}")
        if torch.float64 in dtypes:
            raise BackendUnavailableError("backend='triton' does not take float64 inputs; "
                                          "use backend='torch' or 'auto'")
        return TritonDivergenceKernel()
    if ok and device.type == "cuda" and torch.float64 not in dtypes:
        return TritonDivergenceKernel()
    return TorchDivergenceKernel()


def run_divergence(hs, ws, bs, ht, wt, bt, valid_rows, n_valid: int, spec: DivergenceSpec,
                   per_row: bool, want_entropy: bool, logits_budget: int | None,
                   backend: str = "auto", scale=1.0):
    """Validated call (``fused_ce_patch.distill``) → ``(D, entropy)`` of
    :class:`ChunkedDivergence`."""
    kernel = select_kernel(hs.device, (hs.dtype, ht.dtype), backend)
    budget = default_budget(hs.device) if logits_budget is None else logits_budget
    grad_on = torch.is_grad_enabled()

    def req(t):
        return bool(grad_on and t is not None and t.requires_grad)

    need_t = any(req(t) for t in (ht, wt, bt))
    rows = chunk_rows(n_valid, ws.shape[0],
                      kernel.bytes_per_column(hs.dtype, ht.dtype, spec, need_t), budget)

    cfg = DistillConfig(kernel=kernel, spec=spec, rows=rows, n_valid=n_valid, per_row=per_row,
                        want_entropy=want_entropy, scale=scale,
                        need=tuple(req(t) for t in (hs, ws, bs, ht, wt, bt)))
    return ChunkedDivergence.apply(hs, ws, bs, ht, wt, bt, valid_rows, cfg)

"""Backend ``"torch"``: the chunked algorithm of :mod:`.chunked` with plain torch ops.

Runs on any device torch runs on (CPU, MPS, XPU, NPU without triton-ascend, CUDA without
Triton). Each chunk's logits are upcast to float32 (float64 for float64 inputs) for the
softmax, and dW/db accumulate in that precision across chunks; peak transient memory is
``rows * vocab_tile * bytes_per_logit`` and follows ``logits_budget``, never ``N * V``.

``logits_budget=0`` has no on-chip meaning here; it selects the recompute schedule with
tiles of :data:`MIN_TILE_BYTES`.
"""

from __future__ import annotations

import torch

from .base import Backend, LossSpec, Problem
from .chunked import LogitsKernel, finish_loss, run_chunked

#: Default transient-logits budget on CPU and other non-Triton devices (bytes). About 390
#: float32 rows of a 128k vocabulary: CPU BLAS runs the three per-chunk matmuls near its
#: large-matrix speed from a few hundred rows on (benchmarks/cpu_chunked.py).
DEFAULT_BUDGET = 192 * 2**20
#: Tile size used when ``logits_budget=0`` is asked of this backend (bytes).
MIN_TILE_BYTES = 2**20

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _work(z: torch.Tensor) -> torch.Tensor:
    """The chunk in the working precision (float32, or float64 for float64)."""
    return z if z.dtype in (torch.float32, torch.float64) else z.float()


def _softcap_(s: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    if spec.softcap is not None:
        s.div_(spec.softcap).tanh_().mul_(spec.softcap)
    return s


def _column(scale, like: torch.Tensor):
    """``scale`` shaped to broadcast over the columns of ``like`` ([r, v])."""
    if isinstance(scale, torch.Tensor):
        scale = scale.to(like.dtype)
        return scale.reshape(-1, 1) if scale.dim() == 1 else scale
    return scale


def _grad_from_probs_(p, s, y, v0, vocab, lse, spec: LossSpec, scale):
    """Turn ``p = softmax`` (in place) into ``scale * dL/dz``; ``s`` are the softcapped logits
    (needed only for the softcap chain rule; may be None without softcap)."""
    eps = spec.label_smoothing
    if spec.z_loss:
        p.mul_((1.0 + 2.0 * spec.z_loss * lse).unsqueeze(1))
    inside = (y >= v0) & (y < v0 + p.shape[1])
    col = (y - v0).clamp(0, p.shape[1] - 1).unsqueeze(1)
    hit = inside.to(p.dtype).mul_(-(1.0 - eps)).unsqueeze(1)
    p.scatter_add_(1, col, hit)
    if eps:
        p.sub_(eps / vocab)
    if spec.softcap is not None:
        # d/dz [c tanh(z/c)] = 1 - tanh(z/c)^2 = 1 - (s/c)^2
        p.mul_(s.div_(spec.softcap).square_().neg_().add_(1.0))
    scale = _column(scale, p)
    if not (isinstance(scale, float) and scale == 1.0):
        p.mul_(scale)
    return p


class TorchKernel(LogitsKernel):
    """Chunk arithmetic in torch ops, in float32 (float64 for float64 inputs)."""

    dw_accumulate = "fp32"
    precise_lse = True
    tile_dh_fp32 = True

    def bytes_per_column(self, dtype: torch.dtype, hidden_size: int) -> int:
        # the float32 copy of a weight tile that keeps tiled dH partials unrounded
        return 4 * hidden_size if dtype in (torch.float16, torch.bfloat16) else 0

    def bytes_per_logit(self, dtype: torch.dtype, spec: LossSpec) -> int:
        work = 8 if dtype == torch.float64 else 4
        low = 0 if dtype in (torch.float32, torch.float64) else 2 * torch.finfo(dtype).bits // 8
        # matmul output (+ its working copy) + probabilities (+ softcapped logits kept for
        # the chain rule) + the low-precision copy of dz fed to the dH matmul.
        return work + (work if spec.softcap is not None else 0) + low

    def _stats_full(self, z, y, spec):
        s = _softcap_(_work(z), spec)
        z_t = s.gather(1, y.unsqueeze(1)).squeeze(1)
        z_s = s.sum(1) if spec.label_smoothing else None
        m = s.amax(1)
        return s, z_t, z_s, m

    def row_loss(self, z, y, spec):
        s, z_t, z_s, m = self._stats_full(z, y, spec)
        log_se = s.sub_(m.unsqueeze(1)).exp_().sum(1).log_()
        lse = m + log_se
        # (m - z_t) + log_se, not lse - z_t: lse's rounding would swamp a loss of ~1e-3
        return finish_loss(lse, z_t, z_s, s.shape[1], spec, nll=(m - z_t) + log_se), lse

    def row_loss_grad_(self, z, y, spec, scale):
        s, z_t, z_s, m = self._stats_full(z, y, spec)
        vocab = s.shape[1]
        if spec.softcap is not None:
            p = (s - m.unsqueeze(1)).exp_()
        else:
            p, s = s.sub_(m.unsqueeze(1)).exp_(), None
        sumexp = p.sum(1)
        log_se = sumexp.log()
        lse = m + log_se
        p.div_(sumexp.unsqueeze(1))
        dz = _grad_from_probs_(p, s, y, 0, vocab, lse, spec, scale)
        return finish_loss(lse, z_t, z_s, vocab, spec, nll=(m - z_t) + log_se), lse, dz

    def tile_stats(self, z, y, v0, spec):
        s = _softcap_(_work(z), spec)
        v = s.shape[1]
        inside = (y >= v0) & (y < v0 + v)
        col = (y - v0).clamp(0, v - 1).unsqueeze(1)
        z_t = torch.where(inside, s.gather(1, col).squeeze(1), 0.0)
        z_s = s.sum(1) if spec.label_smoothing else torch.zeros_like(z_t)
        m = s.amax(1)
        sumexp = s.sub_(m.unsqueeze(1)).exp_().sum(1)
        return m, sumexp, z_t, z_s

    def tile_grad_(self, z, y, v0, vocab, lse, spec, scale):
        s = _softcap_(_work(z), spec)
        hi = lse.to(s.dtype)
        if spec.softcap is not None:
            p = s - hi.unsqueeze(1)  # s is still needed for the softcap chain rule
        else:
            p, s = s.sub_(hi.unsqueeze(1)), None
        if lse.dtype != hi.dtype:  # float64 LSE (precise_lse): subtract its low part too
            p.sub_((lse - hi.double()).to(p.dtype).unsqueeze(1))
        return _grad_from_probs_(p.exp_(), s, y, v0, vocab, hi, spec, scale)


class TorchBackend(Backend):
    """Chunked pure-torch backend; runs wherever torch does."""

    name = "torch"
    priority = 0
    device_types = ()

    def __init__(self):
        self.kernel = TorchKernel()

    def accepts(self, device, dtype):
        if dtype not in _FLOATS:
            return False, f"dtype {dtype} is not a floating type"
        return True, ""

    def run(self, problem: Problem) -> torch.Tensor:
        budget = problem.logits_budget
        if budget is None:
            return run_chunked(problem, self.kernel, DEFAULT_BUDGET)
        if budget == 0:
            return run_chunked(problem, self.kernel, MIN_TILE_BYTES, eager=False)
        return run_chunked(problem, self.kernel, budget)

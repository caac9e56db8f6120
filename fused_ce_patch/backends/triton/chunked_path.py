"""Chunked path of backends ``"triton"`` and ``"ascend"`` (``logits_budget > 0``).

Counted rows are cut into chunks whose logits fit the budget; per chunk::

    z      = h_c @ W.T (+ b)                  torch matmul (cuBLAS), input dtype, [r, V]
    z      = logits_grad(z)                   one Triton kernel: LSE, loss, and scale * dL/dz
                                              written over z, except the target column,
                                              whose value goes to a float32 coef_r
    dW    += z.T @ h_c                        addmm into dW (input dtype; the first chunk a
                                              plain matmul into the empty dW): the matmul
                                              reads dW in float32 compute, one rounding/chunk
    db    += z.sum(0)                         float32
    dH[rows] = z @ W + coef_r W[y_r]          matmul with a float32 output, the target column
                                              added in float32 (dhidden_rows), rounded once
and once at the end ``dW[y] += sum coef_r h_r`` (target column, float32, one rounding).

The kernels are called through ``cfg.launchers`` (:class:`~.launch.Launchers`): the CUDA
kernels by default, the NPU's persistent-grid kernels for backend ``"ascend"``.

No float32 copy of a chunk is made and nothing waits on the device inside the loop.

Why a driver of its own rather than :func:`fused_ce_patch.backends.chunked.run_chunked`: the
shared driver accumulates dW either in a float32 ``[V, H]`` buffer (2.4 GB at Gemma-2's size,
against a 256 MiB target) or by bf16 chunk sums, which loses precision (dW error 4.1e-3 vs
3.1e-3 for PyTorch's bf16 path at 9 chunks, float64-simulated). Splitting off the target part
(kernels module docstring) brings dW to ~1.7e-3 with no extra memory; that needs steps between
the kernel and the matmuls that the shared interface does not have. dH takes the same
target column in float32 too (2026-12-03; it went through the bf16 matmul with the rest, as
PyTorch's path does, before).

Schedules, as in the shared driver: *eager* (scalar reductions with gradients, bfloat16 and
float32: gradients are formed in forward, 3 matmuls) and *recompute* (``reduction="none"``, and
every float16 call: forward keeps one LSE per counted row, backward recomputes the logits and
forms the gradient at the real upstream scale, one per row if need be). float16 cannot hold a
gradient formed before its upstream scale is known (``fp16`` loss scaling exists for that
reason): see :func:`fused_ce_patch.backends.chunked.forward_grad_safe`.

Precision choices are passed to the matmuls (:func:`_mm_fp32`); no process-wide torch flag
is read or set.

Schedule variants for measurement (issue 14; :class:`ChunkedTuning`, internal, default off):
the logits of chunk ``i + 1`` formed on a second CUDA stream into a second buffer while chunk
``i``'s kernel and matmuls run (``overlap``), dH's matmul before dW's (``dh_first``), a
factor on the rows per chunk (``rows``) and the row kernel's launch (``block_v``, ``warps``,
``stages``, ``programs``). Backend ``"triton"`` reads them from the environment variable
:data:`TUNING_ENV` (:func:`tuning_from_env`); each computes the same operations with the same
roundings as the default schedule (a different ``block_v`` or ``rows`` only reorders float32
sums, or moves the chunk boundaries of dW's bf16 accumulation).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from ...errors import single_backward
from ..base import LossSpec
from ..chunked import RowSource
from .launch import CUDA_LAUNCHERS, Launchers, RowKernelConfig, _pow2, row_offsets

#: Internal environment variable with schedule variants of the chunked path, for measurements
#: (issue 14); read by backend ``"triton"`` on each call. Syntax: comma-separated items,
#: ``overlap``, ``dh_first``, ``fast_math`` (flags; ``=0``/``=1`` also taken),
#: ``rows=<factor>``, ``block_v=<pow2>``, ``warps=<pow2>``, ``stages=<int>``,
#: ``programs=<per SM>``, ``sub_rows=<pow2>``; see :class:`ChunkedTuning`. Unset or empty:
#: the default schedule.
TUNING_ENV = "FUSED_CE_CHUNKED_TUNING"


@dataclass(frozen=True)
class ChunkedTuning:
    """Schedule variants of the chunked path (all off by default; issue 14 measures them).

    Attributes:
        overlap: form the logits of the next chunk into a second ``[rows, V]`` buffer while
            the current chunk's row kernel and matmuls run: on a second CUDA stream for CUDA
            tensors (event-ordered with the current stream); elsewhere the same double-buffered
            order on one stream (so the interpreter tests the buffer handling). Rows per chunk
            are halved so the two buffers take the memory of one (``rows`` applies on top).
        dh_first: dH's matmul before dW's addmm (the target column is written into the
            chunk for dH and zeroed again before dW; the same products and roundings).
        rows: factor on the rows per chunk that the budget allows (memory grows with it).
        block_v, warps, stages: launch of the row kernel (CUDA launchers only; None: the
            defaults of :func:`~.launch.row_kernel_config`).
        programs: row kernel as a persistent grid of ``programs`` x SM-count programs, each
            looping over rows (0: one program per row).
        sub_rows: the row kernel's LSE pass over ``[sub_rows, block_v / sub_rows]`` tiles with
            one running max per segment (power of two, at most ``block_v``; None: default).
        fast_math: False turns the row kernel's PTX ``exp``/reciprocal approximations off
            (None: the default, on for NVIDIA GPUs; True cannot turn them on elsewhere).
    """

    overlap: bool = False
    dh_first: bool = False
    rows: float = 1.0
    block_v: int | None = None
    warps: int | None = None
    stages: int | None = None
    programs: float = 0.0
    sub_rows: int | None = None
    fast_math: bool | None = None

    def __post_init__(self):
        if not (0 < self.rows < math.inf):
            raise ValueError(f"{TUNING_ENV}: rows must be a positive factor, got {self.rows}")
        if not (0 <= self.programs < math.inf):
            raise ValueError(f"{TUNING_ENV}: programs must be >= 0, got {self.programs}")
        for name in ("block_v", "warps", "sub_rows"):
            v = getattr(self, name)
            if v is not None and (v < 1 or v & (v - 1)):
                raise ValueError(f"{TUNING_ENV}: {name} must be a power of two, got {v}")
        if self.stages is not None and self.stages < 1:
            raise ValueError(f"{TUNING_ENV}: stages must be >= 1, got {self.stages}")

    @property
    def rows_factor(self) -> float:
        """Factor on the budget's rows per chunk (``overlap`` halves them)."""
        return self.rows * (0.5 if self.overlap else 1.0)

    @property
    def tunes_row_kernel(self) -> bool:
        tuned = (self.block_v, self.warps, self.stages, self.sub_rows, self.fast_math)
        return tuned != (None,) * 5 or self.programs > 0

    def row_config(self, default: RowKernelConfig, vocab: int) -> RowKernelConfig:
        """``default`` with the fields this tuning sets (``block_v`` at most ``pow2(V)``,
        ``sub_rows`` at most ``block_v``)."""
        block_v = default.block_v if self.block_v is None else min(self.block_v, _pow2(vocab))
        # at most block_v segments also for the default's (CUDA: 16 once block_v >= 4096), so a
        # smaller tuned block_v never leaves a segment of block_v // sub_rows = 0 logits
        sub_rows = min(default.sub_rows if self.sub_rows is None else self.sub_rows, block_v)
        return RowKernelConfig(
            block_v=block_v,
            num_warps=default.num_warps if self.warps is None else self.warps,
            num_stages=default.num_stages if self.stages is None else self.stages,
            sub_rows=sub_rows,
            fast_math=default.fast_math and self.fast_math is not False,
        )


_FLAGS = ("overlap", "dh_first", "fast_math")
_NUMBERS = {"rows": float, "block_v": int, "warps": int, "stages": int, "programs": float,
            "sub_rows": int}


@functools.lru_cache(maxsize=32)
def parse_tuning(text: str) -> ChunkedTuning:
    """:class:`ChunkedTuning` from the syntax of :data:`TUNING_ENV`.

    Raises:
        ValueError: an unknown key, a missing or malformed value, or a value out of range.
    """
    kw = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        key, eq, value = (s.strip() for s in item.partition("="))
        if key in _FLAGS:
            if eq and value not in ("0", "1"):
                raise ValueError(f"{TUNING_ENV}: {key} takes 0 or 1, got {value!r}")
            kw[key] = value != "0"
        elif key in _NUMBERS:
            if not eq:
                raise ValueError(f"{TUNING_ENV}: {key} needs a value ({key}=...)")
            try:
                kw[key] = _NUMBERS[key](value)
            except ValueError:
                raise ValueError(f"{TUNING_ENV}: {key}={value!r} is not a number") from None
        else:
            known = ", ".join((*_FLAGS, *_NUMBERS))
            raise ValueError(f"{TUNING_ENV}: unknown item {key!r} (known: {known})")
    return ChunkedTuning(**kw)


def tuning_from_env() -> ChunkedTuning:
    """The variants named in :data:`TUNING_ENV` (the defaults when unset)."""
    return parse_tuning(os.environ.get(TUNING_ENV, ""))


@dataclass
class ChunkedConfig:
    """Non-tensor arguments of :class:`TritonChunkedLinearCrossEntropy`."""

    spec: LossSpec
    reduction: str  # "none" | "sum"
    scale: float | torch.Tensor
    n_valid: int
    rows: int  # counted rows per chunk
    eager: bool
    need: tuple[bool, bool, bool]
    launchers: Launchers = CUDA_LAUNCHERS
    tuning: ChunkedTuning = ChunkedTuning()


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b`` as a float32 tensor, the 16-bit operands' products summed in float32 with no
    rounding of the result; None where that is not available (CUDA torch without ``mm``'s
    ``out_dtype``, before 2.8; devices other than CUDA and the CPU, e.g. Ascend NPUs).

    torch lets cuBLAS reduce the split-K partial sums of 16-bit matmuls in the input dtype
    (``allow_{fp16,bf16}_reduced_precision_reduction``, on by default); dH's matmul (``K = V``,
    few rows) is where cuBLAS splits K, which cost fp16 dH 1.35x PyTorch's error on an H200.
    Asking this one matmul for a float32 output (``out_dtype``, CUDA) keeps its reduction in
    float32 without touching those process-wide flags, which other threads and other code
    read. On the CPU (the interpreter's small shapes) the operands are widened exactly first;
    elsewhere a float32 copy of a chunk would double its memory, so None.
    """
    if a.dtype not in (torch.float16, torch.bfloat16):
        return torch.mm(a, b).float()
    if a.device.type == "cpu":
        return torch.mm(a.float(), b.float())
    if a.device.type != "cuda":
        return None
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):  # torch without mm.dtype
        return None


def plan_rows(n_valid: int, rows_max: int) -> int:
    """Rows per chunk: as few chunks as ``rows_max`` allows, all of (nearly) equal size, so the
    last chunk is not a sliver that runs the matmuls at a fraction of their speed."""
    rows_max = max(1, rows_max)
    chunks = max(1, -(-n_valid // rows_max))
    return max(1, -(-n_valid // chunks))


@dataclass
class _Grads:
    dh: torch.Tensor | None
    dw: torch.Tensor | None
    db: torch.Tensor | None
    #: dW is uninitialised until the first chunk writes it (a plain matmul, not an addmm into
    #: zeros: saves a fill and a read of the whole [V, H] dW; the fill was 0.33 ms at
    #: Llama-3's size on an H200).
    dw_fresh: bool = False


def _new_grads(hidden, weight, bias, need) -> _Grads:
    need_h, need_w, need_b = need
    n = hidden.numel() // hidden.shape[-1]
    dev = hidden.device
    return _Grads(
        dh=torch.zeros(n, hidden.shape[-1], dtype=hidden.dtype, device=dev) if need_h else None,
        dw=torch.empty_like(weight, memory_format=torch.contiguous_format) if need_w else None,
        db=torch.zeros(weight.shape[0], dtype=torch.float32, device=dev)
        if (need_b and bias is not None)
        else None,
        dw_fresh=need_w,
    )


def _logits(h, weight, bias):
    if bias is None:
        return torch.mm(h, weight.t())
    return torch.addmm(bias, h, weight.t())


def _logits_into(z, h, weight, bias):
    """:func:`_logits` written into ``z`` (the same matmul, with ``out=``)."""
    if bias is None:
        torch.mm(h, weight.t(), out=z)
    else:
        torch.addmm(bias, h, weight.t(), out=z)


def _backprop_chunk(dz, h, idx, y, coef, weight, grads: _Grads, rows: slice | None,
                    dh_first: bool = False, launchers: Launchers = CUDA_LAUNCHERS):  # fmt: skip
    """Add one chunk's gradient into dH, dW, db. ``dz`` holds the dense part (0 in each row's
    target column); dW and db take it as is (their target part comes later, in float32), dH
    gets the target column added in float32 to ``dz @ W`` before its one rounding
    (:func:`_dhidden_chunk`). ``idx``: the chunk's rows of dH; ``rows``: the same as a slice
    when they are contiguous (else None). ``dh_first`` (:class:`ChunkedTuning`): dH's matmul
    before dW's, the same products."""
    if grads.dh is not None and dh_first:
        _dhidden_chunk(dz, idx, y, coef, weight, grads, rows, launchers)
    if grads.dw is not None and grads.dw_fresh:
        torch.mm(dz.t(), h, out=grads.dw)
        grads.dw_fresh = False
    elif grads.dw is not None:
        grads.dw.addmm_(dz.t(), h)
    if grads.db is not None:
        grads.db += dz.sum(0, dtype=torch.float32)
    if grads.dh is not None and not dh_first:
        _dhidden_chunk(dz, idx, y, coef, weight, grads, rows, launchers)


def _dhidden_chunk(dz, idx, y, coef, weight, grads: _Grads, rows: slice | None,
                   launchers: Launchers):  # fmt: skip
    """``dH[rows] = dz @ W + coef_r W[y_r]``: the dense part's product in float32
    (:func:`_mm_fp32`), the target column added in float32, one rounding
    (:meth:`~.launch.Launchers.dhidden_rows`). Writing ``coef_r`` into ``dz``'s target column
    instead, as PyTorch's path has it, rounds the largest entry of each row's gradient to
    the input dtype: 1.4-1.9x the dH error against float32 logits at bf16 (H200)."""
    # the loss passes its counted rows' indices; token statistics pass a slice only
    out_rows = idx if idx is not None else torch.arange(rows.start, rows.stop, device=dz.device)
    part = _mm_fp32(dz, weight)
    if part is not None:
        launchers.dhidden_rows(grads.dh, out_rows, part=part, coef=coef, labels=y,
                               weight=weight)  # fmt: skip
        return
    # no float32 product (torch < 2.8 on CUDA, NPUs): a 16-bit dense part would lose the small
    # gradients (fp16 subnormals) before the target joins it, so the target column goes
    # through the matmul with the rest, as PyTorch's path has it, and is zeroed again after
    dz.scatter_(1, y.unsqueeze(1), coef.unsqueeze(1).to(dz.dtype))
    launchers.dhidden_rows(grads.dh, out_rows, part=torch.mm(dz, weight))
    dz.scatter_(1, y.unsqueeze(1), 0.0)


def _finish(launchers: Launchers, grads: _Grads, hidden, valid_rows, y_valid, coef):
    """Target part of dW/db for every counted row (dW zeroed first if no chunk wrote it)."""
    if grads.dw is not None and grads.dw_fresh:
        grads.dw.zero_()
        grads.dw_fresh = False
    if grads.dw is not None or grads.db is not None:
        launchers.target_dweight(
            grads.dw, grads.db, y_valid, coef, hidden, row_offsets(hidden, valid_rows)
        )


def _chunks(cfg: ChunkedConfig, hidden, valid_rows, y_valid):
    """``(start, stop, idx, h_c, y_c, rows)`` per chunk; when every row counts, ``h_c`` is a
    view and ``rows`` the chunk's slice of the ``[N, H]`` rows (else None)."""
    rows = RowSource(hidden)
    dense = cfg.n_valid == valid_rows.shape[0] == rows.lead_shape.numel() and rows.flat is not None
    for start in range(0, cfg.n_valid, cfg.rows):
        stop = min(cfg.n_valid, start + cfg.rows)
        idx = valid_rows[start:stop]
        h = rows.flat[start:stop] if dense else rows.take(idx)
        yield start, stop, idx, h, y_valid[start:stop], slice(start, stop) if dense else None


def _logit_chunks(cfg: ChunkedConfig, hidden, weight, bias, valid_rows, y_valid):
    """:func:`_chunks` with each chunk's logits ``z`` ``[r, V]`` appended, which the caller
    may overwrite until it asks for the next chunk. Serial by default: ``z`` is formed when the
    chunk is handed out. With ``cfg.tuning.overlap``: :func:`_prefetched_logit_chunks`."""
    if cfg.tuning.overlap:
        yield from _prefetched_logit_chunks(cfg, hidden, weight, bias, valid_rows, y_valid)
        return
    for chunk in _chunks(cfg, hidden, valid_rows, y_valid):
        yield (*chunk, _logits(chunk[3], weight, bias))


_SIDE_STREAMS: dict = {}


def _side_stream(dev: torch.device):
    """One side stream per device, kept: cuBLAS keeps a workspace per (handle, stream), so a
    fresh stream per call (torch hands out a pool of 32 round-robin) would let up to 32
    workspaces accumulate."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS.setdefault(index, torch.cuda.Stream(device=index))
    return stream


def _prefetched_logit_chunks(cfg: ChunkedConfig, hidden, weight, bias, valid_rows, y_valid):
    """Double-buffered logits: chunk ``i + 1``'s matmul is issued into the second of two
    ``[rows, V]`` buffers before chunk ``i`` is handed out, so that it runs while the caller's
    kernel and matmuls on chunk ``i`` run.

    CUDA: the matmul runs on a side stream. Order, per chunk: the side stream waits for
    everything issued so far on the current stream (chunk ``i - 1``'s consumers, the last
    readers of the buffer it overwrites, and the gather of its hidden rows), computes, records
    an event; the current stream waits for that event before the chunk is handed out. The
    buffers and gathered rows are marked as used by the side stream (``record_stream``) so the
    caching allocator never hands their memory to another stream early, and on exit (normal
    or not) the current stream waits for the side stream. Elsewhere (the interpreter) the same
    order runs on one stream, which still checks that no chunk overwrites a buffer in use.
    """
    dev = hidden.device
    bufs = [torch.empty(min(cfg.rows, cfg.n_valid), weight.shape[0], dtype=hidden.dtype,
                        device=dev) for _ in range(2)]  # fmt: skip
    side = _side_stream(dev) if dev.type == "cuda" else None
    main = torch.cuda.current_stream(dev) if side is not None else None

    def issue(k, chunk):
        z = bufs[k % 2][: chunk[1] - chunk[0]]
        if side is None:
            _logits_into(z, chunk[3], weight, bias)
            return (*chunk, z), None
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _logits_into(z, chunk[3], weight, bias)
            ready = torch.cuda.Event()
            ready.record(side)
        chunk[3].record_stream(side)
        return (*chunk, z), ready

    if side is not None:
        for b in bufs:
            b.record_stream(side)
    chunks = iter(_chunks(cfg, hidden, valid_rows, y_valid))
    first = next(chunks, None)
    pending = issue(0, first) if first is not None else None
    k = 0
    try:
        while pending is not None:
            item, ready = pending
            if ready is not None:
                main.wait_event(ready)
            nxt = next(chunks, None)
            pending = issue(k + 1, nxt) if nxt is not None else None
            yield item
            k += 1
    finally:
        if side is not None:
            main.wait_stream(side)


def _eager_pass(cfg: ChunkedConfig, hidden, weight, bias, valid_rows, y_valid, need):
    """Loss, LSE and ``cfg.scale * gradients`` of every counted row in one pass over chunks."""
    m, dev = cfg.n_valid, hidden.device
    loss_v = torch.empty(m, dtype=torch.float32, device=dev)
    lse_v = torch.empty(m, dtype=torch.float32, device=dev)
    nll_v = torch.empty(m, dtype=torch.float32, device=dev)
    coef_v = torch.empty(m, dtype=torch.float32, device=dev)
    grads = _new_grads(hidden, weight, bias, need)
    for start, stop, idx, h, y, rows, z in _logit_chunks(cfg, hidden, weight, bias, valid_rows,
                                                         y_valid):  # fmt: skip
        cfg.launchers.logits_grad(
            z, y, lse_v[start:stop], nll_v[start:stop], loss_v[start:stop],
            coef_v[start:stop], cfg.scale, cfg.spec, compute_lse=True, write_grad=True,
        )
        _backprop_chunk(z, h, idx, y, coef_v[start:stop], weight, grads, rows,
                        cfg.tuning.dh_first, cfg.launchers)  # fmt: skip
        del z, h
    _finish(cfg.launchers, grads, hidden, valid_rows, y_valid, coef_v)
    return loss_v, lse_v, nll_v, grads


def _stats_pass(cfg: ChunkedConfig, hidden, weight, bias, valid_rows, y_valid):
    """Loss, LSE and ``LSE - z_y`` of every counted row (no gradient)."""
    m, dev = cfg.n_valid, hidden.device
    loss_v = torch.empty(m, dtype=torch.float32, device=dev)
    lse_v = torch.empty(m, dtype=torch.float32, device=dev)
    nll_v = torch.empty(m, dtype=torch.float32, device=dev)
    for start, stop, _, h, y, _, z in _logit_chunks(cfg, hidden, weight, bias, valid_rows,
                                                    y_valid):  # fmt: skip
        cfg.launchers.logits_grad(
            z, y, lse_v[start:stop], nll_v[start:stop], loss_v[start:stop], None, 1.0,
            cfg.spec, compute_lse=True, write_grad=False,
        )
        del z, h
    return loss_v, lse_v, nll_v


def _recompute_pass(cfg: ChunkedConfig, hidden, weight, bias, valid_rows, y_valid, lse_v, nll_v,
                    scale, need):
    """Gradients from the saved LSE; ``scale`` is a 0-d tensor or ``[N]`` per-row weights."""
    grads = _new_grads(hidden, weight, bias, need)
    coef_v = torch.empty(cfg.n_valid, dtype=torch.float32, device=hidden.device)
    for start, stop, idx, h, y, rows, z in _logit_chunks(cfg, hidden, weight, bias, valid_rows,
                                                         y_valid):  # fmt: skip
        s = scale.index_select(0, idx) if scale.dim() == 1 else scale
        cfg.launchers.logits_grad(
            z, y, lse_v[start:stop], nll_v[start:stop], None, coef_v[start:stop], s,
            cfg.spec, compute_lse=False, write_grad=True,
        )
        _backprop_chunk(z, h, idx, y, coef_v[start:stop], weight, grads, rows,
                        cfg.tuning.dh_first, cfg.launchers)  # fmt: skip
        del z, h
    _finish(cfg.launchers, grads, hidden, valid_rows, y_valid, coef_v)
    return grads


def _forward_pass(cfg: ChunkedConfig, hidden, weight, bias, valid_rows, y_valid):
    if cfg.eager:
        return _eager_pass(cfg, hidden, weight, bias, valid_rows, y_valid, cfg.need)
    return (*_stats_pass(cfg, hidden, weight, bias, valid_rows, y_valid), None)


class TritonChunkedLinearCrossEntropy(torch.autograd.Function):
    """``apply(hidden, weight, bias, labels, valid_rows, cfg)`` → ``[N]`` float32 losses
    (``"none"``) or the 0-d ``scale * sum``. See the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid_rows, cfg: ChunkedConfig):
        y_valid = labels.index_select(0, valid_rows)
        loss_v, lse_v, nll_v, grads = _forward_pass(cfg, hidden, weight, bias, valid_rows, y_valid)
        ctx.cfg = cfg
        ctx.grads = grads
        if any(cfg.need):
            ctx.save_for_backward(hidden, weight, bias, valid_rows, y_valid, lse_v, nll_v)
        if cfg.reduction == "none":
            out = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device)
            return out.index_copy_(0, valid_rows, loss_v)
        return loss_v.sum() * cfg.scale

    @staticmethod
    @single_backward
    def backward(ctx, grad_out):
        cfg: ChunkedConfig = ctx.cfg
        hidden, weight, bias, valid_rows, y_valid, lse_v, nll_v = ctx.saved_tensors
        if cfg.eager:
            grads: _Grads | None = ctx.grads
            # Handed to autograd, which may adopt the buffers as .grad without a copy; a second
            # backward through a retained graph replays the same pass (bitwise the same).
            ctx.grads = None
            if grads is None:
                *_, grads = _eager_pass(cfg, hidden, weight, bias, valid_rows, y_valid, cfg.need)
            # the upstream scale in float32, one rounding; no host sync (CUDA)
            cfg.launchers.scale_unless_one((grads.dh, grads.dw, grads.db), grad_out)
            return _outputs(grads, hidden.shape, bias)

        need = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        if cfg.reduction == "none":
            scale = grad_out.reshape(-1).to(torch.float32)
        else:
            scale = grad_out.to(torch.float32) * cfg.scale
        grads = _recompute_pass(cfg, hidden, weight, bias, valid_rows, y_valid, lse_v, nll_v,
                                scale, need)
        return _outputs(grads, hidden.shape, bias)


def _outputs(grads: _Grads, hidden_shape, bias):
    dh = None if grads.dh is None else grads.dh.view(hidden_shape)
    db = None if grads.db is None else grads.db.to(bias.dtype)
    return dh, grads.dw, db, None, None, None

"""In-place backward of the zero-logits path (``logits_budget=0``): exact, deterministic, no
float32 atomics, and no memory beyond dH, dW and a few MiB.

The logits are recomputed in backward one *vocabulary chunk* at a time, for every row of
``hidden`` (rows not counted get a zero gradient), into storage that backward has to allocate
anyway and has not filled yet: dH's own storage, then the not-yet-written rows of dW. Every
product is a plain cuBLAS matmul that owns its output (no two programs write the same
element, so the result is the same bits run after run), and every reduction is in float32:

    acc   = float32 [N, H], in the last 2N rows of dW's storage     (dH's accumulator)
    for each chunk C of <= H/2 columns below those rows (its logits in dH's storage):
        Z     = hidden @ W[C].T                 cuBLAS, float32 output
        G     = logits_grad_cols(Z + b[C])      Triton: scale * dL/dz in the input dtype,
                                                target column 0, written over Z row by row
        acc  += G @ W[C]                        cuBLAS, float32 output (reduction in float32)
        dW[C] = G.T @ hidden                    cuBLAS, written once
        db[C] = sum_rows G                      float32
    for each chunk C of the last columns (those under acc): G as above, acc += G @ W[C]
    acc[r] += coef_r * W[y_r]; dH = acc                   target column in float32, one rounding
    for the last columns, top down, in chunks whose Z fits in the free rows below them (then
    in a TAIL_SCRATCH_BYTES buffer): G as above, dW[C] = G.T @ hidden, db[C]
    dW[y] += sum_{r: y_r = y} coef_r * h_r                  target column, float32

Where rows are ignored (``M < N`` counted) and it saves matmul work (:func:`_compact_pays`),
the first pass runs over the counted rows only: their hidden states gathered into dH's
storage, ``acc`` float32 ``[M, H]`` in dW's last 2M rows, the chunks' logits in dW's first,
still free rows (the columns under ``acc`` first, then the rest top down, the last ones in the
scratch buffer); then ``dH[counted] = acc + coef W[y]`` (one rounding, other rows 0), and the
columns under ``acc`` get their dW from all rows as above.

Chunks are at most H/2 columns wide and, on a GPU, hold at most about its L2 cache's size of
float32 logits (:func:`chunk_cols`): the matmul's output is then read back from L2.

On Hopper (:func:`_tma_grad`: the TMA forward's device conditions and operands with 16-byte
aligned rows) ``Z`` and ``G`` are one Triton GEMM over TMA descriptors with the gradient in
its epilogue (:func:`~.kernels.grad_tma_kernel`): the float32 logits stay in registers, only
``G`` (16-bit) is stored, so a chunk's buffer needs one 16-bit element per logit, not two
(:meth:`_Chunks.slots`): chunks of up to H columns in dH's storage and as wide as the room
allows in dW's free rows, L2-sized in 16-bit values. The same
products and float32 sums; ``Z`` differs from cuBLAS's in float32 summation order only.

The logits are float32 (as in forward, whose LSE the gradient uses: 16-bit logits against a
float32 LSE tripled the gradient error in a test). The target column, ``coef_r``: kernels
module docstring. The matmuls run at cuBLAS speed; the vocabulary columns under ``acc`` (2N
of V) are recomputed twice, so the backward costs ``3 + 2N/V`` logits matmuls. dH is rounded
once (float32 accumulator); dW once per element (its reduction over rows is inside one
matmul), plus once more for the rows that are some row's target.

Runs when hidden and weight both need gradients, are float16/bfloat16 of one dtype, the rows
of ``hidden`` form one ``[N, H]`` matrix with unit column stride (and ``W`` unit column
stride), ``V >= 2N``, ``N <= MAX_ROWS_PER_HIDDEN * H`` (``MAX_ROWS_PER_HIDDEN_TMA`` with the
TMA gradient), the tail buffer holds a chunk of a
useful width, and (on GPUs) torch has float32-output matmuls for 16-bit operands on NVIDIA;
otherwise the tiled kernels (:mod:`.zero_logits`) run.

Source: the recomputing backward of Wijmans et al., "Cut Your Losses in Large-Vocabulary
Language Models" (2024), reorganised by vocabulary chunks so that each product is one
ordinary matmul; the in-place float32 accumulation in an output's spare storage as in
:func:`.zero_logits._vocab_groups`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import LossSpec
from .launch import tma_device, tma_operands

#: Whether the in-place backward may run (tests switch it off to reach the tiled kernels).
ENABLED = True
#: Scratch for the last chunks of dW, whose logits no longer fit in free storage (bytes).
TAIL_SCRATCH_BYTES = 4 * 2**20
#: Most rows per hidden unit (``N / H``) for which the in-place backward runs. Its float32
#: logits, their gradient and dH's float32 accumulator cross device memory ~30 bytes per
#: logit, while its matmuls scale with ``N * V * H``: at small ``H`` and many rows it is
#: bandwidth-bound. On an H200 it was 3.0x faster than the tiled kernels at N/H = 2
#: (Llama-3, 8K rows) and 1.3x slower at N/H = 51 (Gemma-3-270M, 32K rows); BENCHMARKS.md.
MAX_ROWS_PER_HIDDEN = 16
#: The same where each chunk's gradient comes from the TMA GEMM (:func:`_tma_grad`): no
#: float32 logits cross memory, and chunks are twice as wide. On an H200 it took 122 ms against
#: the tiled kernels' 162 at N/H = 51 (Gemma-3-270M, 32K rows; BENCHMARKS.md, 2026-12-03);
#: more rows per hidden unit were not measured.
MAX_ROWS_PER_HIDDEN_TMA = 64
#: Fewest vocabulary columns a tail chunk should have; fewer: the tiled kernels run instead.
#: (Read as at least 1: a chunk of no columns would never finish the vocabulary.)
MIN_TAIL_COLS = 16
#: Most vocabulary columns per chunk; None: :func:`chunk_cols` picks by the GPU's L2 size.
MAX_CHUNK_COLS: int | None = None
#: Fewest columns a chunk is cut to for the L2 cache: narrower matmuls lose more than L2 gains.
MIN_L2_CHUNK_COLS = 128
#: The same for chunks of the 16-bit gradient alone (the TMA gradient, :meth:`_Chunks.slots`),
#: which are written once and read twice: at 32K rows on an H200 2048 columns took 276 ms
#: against 291 at the L2 size's 1024 (Llama-3-8B) and 112 against 114 (Gemma-3-270M); at 8K rows
#: the L2 size is already wider (BENCHMARKS.md, 2026-12-03).
MIN_L2_CHUNK_COLS_16BIT = 2048
#: Chunk widths are cut to a multiple of this many columns where room allows, and the rows of a
#: chunk's float32 logits padded to one: rows of a multiple of 16 bytes let cuBLAS take its
#: Hopper kernels. Unaligned chunks (e.g. 5735 x 1629) ran on sm80-era fallbacks, 11 ms of a
#: 56 ms Llama-3 backward on an H200 (BENCHMARKS.md, 2026-12-02 afternoon).
COL_ALIGN = 8
#: Whether the first pass may run over the counted rows only (:func:`_compact_pays`).
COMPACT = True
#: Least fraction of matmul work the counted-rows pass must save to be taken, and the largest
#: share of the vocabulary under its accumulator (2M / V). On an H200, with aligned chunks
#: (``COL_ALIGN``), it was 3-6 % faster than the all-rows pass with 10 % of rows ignored
#: (saving 0.095-0.10 by the count below; Llama-3, Qwen2.5, Gemma-2, Llama-3 at 32K rows),
#: 16-22 % with 30 %, 9 % at Llama-2's V = 32000 with 30 % (2M / V = 0.36), and as fast
#: there with 10 % (2M / V = 0.46). BENCHMARKS.md, 2026-12-02 afternoon.
COMPACT_MIN_SAVING = 0.08
COMPACT_MAX_UNDER = 0.4
#: Whether a chunk's gradient may come from one TMA GEMM with the gradient in its epilogue
#: (``launchers.grad_tma``, :func:`~.kernels.grad_tma_kernel`) where :func:`~.launch.tma_device`
#: holds and the operands suit TMA, instead of a float32 cuBLAS matmul and
#: ``logits_grad_cols`` (tests and probes switch it off).
TMA_GRAD = True
#: float32 accumulator start, in 16-bit elements: 16-byte aligned for the matmuls.
_ALIGN = 8


@dataclass(frozen=True)
class InPlacePlan:
    """Where things live: ``h2`` the ``[N, H]`` view of hidden; dH's float32 accumulator
    starts at element ``acc_start`` of dW's storage (so vocabulary rows ``>= v_acc`` are under
    it); tail chunks of all ``N`` rows have at most ``tail_cols`` columns. ``compact``: the
    accumulator and the first pass hold only the counted rows (module docstring)."""

    h2: torch.Tensor
    acc_start: int
    v_acc: int
    tail_cols: int
    compact: bool = False


def plan(hidden, weight, launchers, need_h: bool, need_w: bool, n_valid: int):
    """An :class:`InPlacePlan`, or None where the tiled kernels must run (module docstring)."""
    if not (ENABLED and need_h and need_w and n_valid > 0):
        return None
    if not hasattr(launchers, "logits_grad_cols"):
        return None
    if hidden.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != hidden.dtype:
        return None
    if hidden.device.type == "cuda" and not _cuda_fp32_out_matmuls():
        return None
    vocab, hsize = weight.shape
    try:
        h2 = hidden.view(-1, hsize)
    except RuntimeError:  # leading dims not one stride: a copy would cost N*H memory
        return None
    if h2.stride(1) != 1 or weight.stride(1) != 1:  # matmuls would copy the operand
        return None
    n = h2.shape[0]
    # the TMA gradient for all rows and for the counted rows gathered into dH's storage
    # (contiguous [M, H]: rows of 16-byte multiples), so both passes take 1 slot a logit
    tma = _tma_grad(h2, weight, launchers) and (hsize * h2.element_size()) % 16 == 0
    slots = 1 if tma else 2
    if n > (MAX_ROWS_PER_HIDDEN_TMA if tma else MAX_ROWS_PER_HIDDEN) * hsize:
        return None
    tail_cols = _cols(_tail_room(n, slots))
    if hsize < 2 or tail_cols < _min_tail_cols():
        return None
    m = n_valid
    if _compact_pays(n, m, vocab, hsize, slots):
        acc_start = _acc_start(vocab, hsize, m)
        return InPlacePlan(h2=h2, acc_start=acc_start, v_acc=acc_start // hsize,
                           tail_cols=tail_cols, compact=True)  # fmt: skip
    acc_start = _acc_start(vocab, hsize, n)
    if acc_start < 0:
        return None
    return InPlacePlan(h2=h2, acc_start=acc_start, v_acc=acc_start // hsize,
                       tail_cols=tail_cols)  # fmt: skip


def _tma_grad(h2, weight, launchers) -> bool:
    """Whether chunk gradients of ``h2``'s rows come from ``launchers.grad_tma`` (one TMA GEMM
    with the gradient in its epilogue, :func:`~.kernels.grad_tma_kernel`): :data:`TMA_GRAD`,
    a :func:`~.launch.tma_device` and operands that suit TMA (16-byte aligned rows)."""
    return (TMA_GRAD and hasattr(launchers, "grad_tma") and tma_device(h2.device)
            and tma_operands(h2, weight))  # fmt: skip


def _compact_pays(n: int, m: int, vocab: int, hsize: int, slots: int = 2) -> bool:
    """Whether the first pass over the ``m < n`` counted rows only costs fewer matmul
    row-columns (by ``COMPACT_MIN_SAVING``) than the pass over all rows, leaves at most
    ``COMPACT_MAX_UNDER`` of the vocabulary under its accumulator, and fits: its logits under
    the accumulator go to dW's rows below it, at least ``MIN_TAIL_COLS`` columns a chunk
    (``slots`` 16-bit elements a logit, :meth:`_Chunks.slots`).
    Row-columns: all rows ``3 V N + 2 N^2`` (three products a column, two more for the ``2N``
    columns under the accumulator); counted rows ``3 V M - 2 M^2 + 4 M N`` (the ``2M`` columns
    under the accumulator get their dW from all ``N`` rows afterwards)."""
    if not COMPACT or m >= n or 2 * m > COMPACT_MAX_UNDER * vocab:
        return False
    acc_start = _acc_start(vocab, hsize, m)
    if acc_start // (slots * m) < _min_tail_cols() or _tail_room(m, slots) < _min_tail_cols():
        return False
    full = 3 * vocab * n + 2 * n * n
    counted = 3 * vocab * m - 2 * m * m + 4 * m * n
    return counted <= (1.0 - COMPACT_MIN_SAVING) * full


def _min_tail_cols() -> int:
    return max(1, MIN_TAIL_COLS)


def _acc_start(vocab: int, hsize: int, rows: int) -> int:
    """First 16-bit element of dW's storage under a float32 ``[rows, H]`` accumulator that
    ends at (or just before) the storage's end; negative where it does not fit."""
    return (vocab * hsize - 2 * rows * hsize) // _ALIGN * _ALIGN


def _acc_view(dw: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """The float32 ``[rows, H]`` accumulator in dW's storage from element ``start`` on."""
    hsize = dw.shape[1]
    return dw.view(-1)[start : start + 2 * rows * hsize].view(torch.float32).view(rows, hsize)


def _chunk_width(rows: int, hsize: int, device, slots: int = 2, in_dh: bool = True) -> int:
    """Columns of one chunk of ``rows`` rows whose logits take ``slots`` 16-bit elements each
    (2: float32 logits; 1: the 16-bit gradient alone, :meth:`_Chunks.slots`): H / slots (then
    N rows fill dH's N * H 16-bit elements), or fewer for the L2 cache (:func:`chunk_cols`).
    With the TMA gradient, chunks whose buffer is not dH's storage (``in_dh`` False: dW's free
    rows, the scratch buffer; their loops cut them to the room there) take the L2 limit alone:
    on an H200 4-5 % faster at Gemma-2 and Gemma-3, Qwen2.5 within noise (BENCHMARKS.md,
    2026-12-03)."""
    l2_cols = chunk_cols(rows, device, 2 * slots)
    if slots == 1 and not in_dh:
        return l2_cols
    return min(_cols(max(1, hsize // slots)), l2_cols)


def _cols(room: int) -> int:
    """The widest chunk that ``room`` float32 columns hold, cut to a multiple of
    ``COL_ALIGN`` (``room`` itself where it is less than one)."""
    return room // COL_ALIGN * COL_ALIGN if room >= COL_ALIGN else room


def _cuda_fp32_out_matmuls() -> bool:
    """Whether torch has cuBLAS matmuls of 16-bit operands with a float32 output
    (``mm``/``addmm`` with ``out_dtype``, torch >= 2.9) on this GPU: checked on NVIDIA only;
    ROCm keeps the tiled kernels (not measured there)."""
    if torch.version.hip is not None:
        return False
    try:
        torch.ops.aten.mm.dtype_out
        torch.ops.aten.addmm.dtype_out
    except AttributeError:
        return False
    return True


def chunk_cols(n: int, device: torch.device, logit_bytes: int = 4) -> int:
    """Most vocabulary columns of one chunk of ``n`` rows: its float32 logits about the size of
    the GPU's L2 cache (nearest multiple of 128 columns, at least ``MIN_L2_CHUNK_COLS``), so
    that what the logits matmul writes is still in L2 when the gradient kernel and the dH and
    dW matmuls read it. On an H200 (60 MiB L2) at 32K rows 512 columns took 342 ms against
    407 at H/2 = 2048 (Llama-3), 256: 444; at 8K rows the H/2 chunks already fit
    (BENCHMARKS.md, 2026-12-02). Chunks of 16-bit gradients (``logit_bytes`` 2) are at least
    ``MIN_L2_CHUNK_COLS_16BIT`` wide. ``MAX_CHUNK_COLS`` overrides; no L2 size known (CPU,
    other devices): no cap."""
    if MAX_CHUNK_COLS:
        return MAX_CHUNK_COLS
    l2 = _l2_bytes(device)
    if not l2:
        return 2**62
    least = MIN_L2_CHUNK_COLS_16BIT if logit_bytes == 2 else MIN_L2_CHUNK_COLS
    return max(least, round(l2 / (logit_bytes * n) / 128) * 128)


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with float32 ``acc`` and 16-bit ``a``, ``b``, reduced in float32.
    CUDA: one cuBLAS call with a float32 output (``out_dtype``); elsewhere (CPU under the
    interpreter) the float32 product of the exactly widened operands."""
    if acc.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _mm_fp32_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b``, float32 ``out``, 16-bit operands, reduced in float32 (as above)."""
    if out.device.type == "cuda":
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


def _overlay(buf: torch.Tensor, n: int, c: int, room: int, slots: int = 2):
    """``(z, g)`` on the 16-bit 1-D ``buf`` (16-byte aligned start): float32 ``z [n, c]`` and
    the 16-bit ``g [n, c]`` whose row ``r`` starts at the first byte of ``z``'s row ``r``. Rows
    are ``c`` rounded up to ``COL_ALIGN`` float32 elements apart where that fits in ``room``
    (``buf`` holds ``n`` rows of ``room`` float32 elements for this chunk), else ``c``. With
    ``slots`` 1 (no float32 logits: :meth:`_Chunks.slots`) ``z`` is None and ``g``'s rows are
    that many 16-bit elements apart (``room`` counts 16-bit elements)."""
    stride = -(-c // COL_ALIGN) * COL_ALIGN
    if stride > room:
        stride = c
    if slots == 1:
        return None, buf[: n * stride].view(n, stride)[:, :c]
    flat = buf[: 2 * n * stride]
    return flat.view(torch.float32).view(n, stride)[:, :c], flat.view(n, 2 * stride)[:, :c]


class _Chunks:
    """The per-row inputs of :meth:`Launchers.logits_grad_cols` for the rows of ``h`` (labels
    ``< 0``: not counted), and the matmuls of one vocabulary chunk."""

    def __init__(self, h, weight, bias, labels, lse, scale, spec: LossSpec, launchers):
        self.h, self.weight, self.bias = h, weight, bias
        self.labels, self.lse, self.scale = labels, lse, scale
        self.spec, self.launchers = spec, launchers
        if spec.z_loss:
            self.p_scale = scale * (1.0 + 2.0 * spec.z_loss * lse)
        else:
            self.p_scale = scale

    @classmethod
    def all_rows(cls, h2, weight, bias, valid_rows, y_valid, lse, row_scale, spec, launchers):
        """Over all ``N`` rows of ``h2``; rows not counted get label -1 and scale 0."""
        n, dev = h2.shape[0], h2.device
        labels = torch.full((n,), -1, dtype=torch.int64, device=dev)
        labels.index_copy_(0, valid_rows, y_valid)
        lse_n = torch.zeros(n, dtype=torch.float32, device=dev).index_copy_(0, valid_rows, lse)
        scale = torch.zeros(n, dtype=torch.float32, device=dev)
        scale.index_copy_(0, valid_rows, row_scale)
        return cls(h2, weight, bias, labels, lse_n, scale, spec, launchers)

    def grad(self, buf: torch.Tensor, v0: int, v1: int, room: int) -> torch.Tensor:
        """``G [rows, v1 - v0]`` (input dtype) of the columns ``[v0, v1)``, in ``buf``'s first
        ``2 slots rows room`` bytes, with the float32 logits it is formed from where
        :meth:`slots` is 2 (:func:`_overlay`)."""
        z, g = _overlay(buf, self.h.shape[0], v1 - v0, room, self.slots())
        if z is None:
            self.launchers.grad_tma(self.h, self.weight, g, self.bias, self.labels, self.lse,
                                    self.p_scale, self.scale, v0, self.spec)  # fmt: skip
            return g
        _mm_fp32_into(z, self.h, self.weight[v0:v1].t())
        self.launchers.logits_grad_cols(z, g, self.bias, self.labels, self.lse, self.p_scale,
                                        self.scale, v0, self.weight.shape[0],
                                        self.spec)  # fmt: skip
        return g

    def slots(self) -> int:
        """16-bit elements a chunk's logit takes in its buffer: 1 where :meth:`grad` forms the
        gradient in one TMA GEMM (:data:`TMA_GRAD`: no float32 logits), else 2."""
        return 1 if _tma_grad(self.h, self.weight, self.launchers) else 2

    def dweight(self, g, dw, db, v0: int, v1: int) -> None:
        torch.mm(g.t(), self.h, out=dw[v0:v1])
        if db is not None:
            db[v0:v1] += g.sum(0, dtype=torch.float32)


def backward(p: InPlacePlan, hidden, weight, bias, valid_rows, y_valid, row_off, lse,
             row_scale, coef, spec: LossSpec, launchers, need_b: bool):  # fmt: skip
    """``(dH [N, H], dW [V, H], db float32 [V] or None)`` of the counted rows (module
    docstring); ``row_scale`` ``[M]`` float32 upstream multipliers, ``coef`` ``[M]`` the target
    column's float32 values."""
    h2 = p.h2
    n, hsize = h2.shape
    vocab = weight.shape[0]
    dev, dt = h2.device, h2.dtype
    dh = torch.empty(n, hsize, dtype=dt, device=dev)
    dw = torch.empty(vocab, hsize, dtype=dt, device=dev)
    db = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_b else None
    every = _Chunks.all_rows(h2, weight, bias, valid_rows, y_valid, lse, row_scale, spec,
                             launchers)  # fmt: skip
    tail = _Scratch(dt, dev)
    if p.compact:
        counted = _Chunks(None, weight, bias, y_valid, lse, row_scale, spec, launchers)
        _first_pass_counted(p, counted, dh, dw, db, valid_rows, y_valid, coef, tail)
    else:
        _first_pass_all(p, every, dh, dw, db, valid_rows, y_valid, coef)

    # dW of the rows under acc, from all rows, top down; each chunk's logits in the free rows
    # below it (acc is spent), then in the scratch buffer
    flat_w = dw.view(-1)
    slots = every.slots()
    width = _chunk_width(n, hsize, dev, slots, in_dh=False)
    lo, hi = p.v_acc, vocab
    while hi > lo:
        start = -(-lo * hsize // _ALIGN) * _ALIGN
        c = _cols(max(0, hi * hsize - start) // (slots * n + hsize))
        c = min(c, max(width, p.tail_cols))
        if c >= p.tail_cols:
            buf, room = flat_w[start:], c  # only c columns are free there: no padding
        else:
            c = min(hi - lo, p.tail_cols)
            buf, room = tail.get(), _tail_room(n, slots)
        g = every.grad(buf, hi - c, hi, room)
        every.dweight(g, dw, db, hi - c, hi)
        hi -= c

    launchers.target_dweight(dw, db, y_valid, coef, hidden, row_off)
    return dh, dw, db


def _tail_room(rows: int, slots: int = 2) -> int:
    """Columns of ``rows`` rows, ``slots`` 16-bit elements each, that the scratch buffer
    holds."""
    return TAIL_SCRATCH_BYTES // (2 * slots * rows)


class _Scratch:
    """The ``TAIL_SCRATCH_BYTES`` buffer, allocated on first use."""

    def __init__(self, dtype, device):
        self.dtype, self.device, self.buf = dtype, device, None

    def get(self) -> torch.Tensor:
        if self.buf is None:
            self.buf = torch.empty(TAIL_SCRATCH_BYTES // 2, dtype=self.dtype, device=self.device)
        return self.buf


def _first_pass_all(p: InPlacePlan, every: _Chunks, dh, dw, db, valid_rows, y_valid, coef):
    """dH of all ``N`` rows (float32 accumulator in dW's last 2N rows, each chunk's logits in
    dH's storage), and dW of the columns below the accumulator."""
    n, hsize = p.h2.shape
    vocab = dw.shape[0]
    acc = _acc_view(dw, p.acc_start, n)
    acc.zero_()
    spare = dh.view(-1)  # dH's storage holds one chunk's logits until dH is formed
    slots = every.slots()
    width = _chunk_width(n, hsize, dh.device, slots)
    below = [(v0, min(v0 + width, p.v_acc)) for v0 in range(0, p.v_acc, width)]
    under = [(v0, min(v0 + width, vocab)) for v0 in range(p.v_acc, vocab, width)]
    for v0, v1 in below + under:
        g = every.grad(spare, v0, v1, max(1, hsize // slots))
        _addmm_fp32_(acc, g, every.weight[v0:v1])
        if v1 <= p.v_acc:
            every.dweight(g, dw, db, v0, v1)
    every.launchers.dhidden_rows(acc, valid_rows, coef=coef, labels=y_valid,
                                 weight=every.weight, accumulate=True)  # fmt: skip
    dh.copy_(acc)  # the one rounding of dH


def _first_pass_counted(p: InPlacePlan, counted: _Chunks, dh, dw, db, valid_rows, y_valid,
                        coef, tail: _Scratch):  # fmt: skip
    """The same over the ``M`` counted rows only: their hidden states gathered into dH's
    storage, the accumulator in dW's last 2M rows, each chunk's logits in dW's rows from the
    start (free until the last chunks, top down, reach them; then the scratch buffer)."""
    hsize = p.h2.shape[1]
    vocab = dw.shape[0]
    m = valid_rows.shape[0]
    flat_w = dw.view(-1)
    counted.h = dh.view(-1)[: m * hsize].view(m, hsize)
    torch.index_select(p.h2, 0, valid_rows, out=counted.h)
    acc = _acc_view(dw, p.acc_start, m)
    acc.zero_()
    weight = counted.weight
    slots = counted.slots()
    width = _chunk_width(m, hsize, dh.device, slots, in_dh=False)
    tail_cols = _cols(_tail_room(m, slots))
    # the columns under acc first (their dW comes from all rows later), logits from row 0 on
    room_under = p.acc_start // (slots * m)
    w_under = min(width, _cols(room_under))
    for v0 in range(p.v_acc, vocab, w_under):
        v1 = min(v0 + w_under, vocab)
        g = counted.grad(flat_w, v0, v1, room_under)
        _addmm_fp32_(acc, g, weight[v0:v1])
    # then the rest, top down, logits below the chunk: slots M c <= (hi - c) H
    hi = p.v_acc
    while hi > 0:
        c = min(width, _cols(hi * hsize // (slots * m + hsize)))
        if c >= tail_cols:
            buf, room = flat_w, c  # only c columns are free there: no padding
        else:
            c = min(hi, tail_cols)
            buf, room = tail.get(), _tail_room(m, slots)
        g = counted.grad(buf, hi - c, hi, room)
        _addmm_fp32_(acc, g, weight[hi - c : hi])
        counted.dweight(g, dw, db, hi - c, hi)
        hi -= c
    dh.zero_()  # rows not counted; the gathered hidden states are spent
    counted.launchers.dhidden_rows(dh, valid_rows, part=acc, coef=coef, labels=y_valid,
                                   weight=weight)  # fmt: skip  (the one rounding of dH)

"""Launch configuration of the ascend kernels: block sizes from the Unified Buffer budget,
grids from the core counts.

:func:`launch_config` is the one place that maps a problem ``(N, H, V, dtype)`` and a chip
(:class:`~.chip.ChipSpec`) to every kernel's block sizes, grid and estimated UB bytes.

The UB model. For each kernel the *live set* is every tile or vector the kernel holds at its
peak (named in the ``*_buffers`` functions below, read off the kernel's code): loads, their
float32 casts, each temporary of the softcap/exponential chain, masks, casts for stores,
the float32 outputs of ``tl.dot`` handed to vector code. Each buffer is rounded up to the
UB's 32-byte alignment along its last axis; the sum is doubled when the compiler
double-buffers (triton-ascend's default ``multibuffer=True``, which its docs describe as
halving the usable UB), and must stay within :data:`SAFETY` of the chip's UB (the rest is
left to the compiler's own scratch). Operand tiles of ``tl.dot`` live on the cube side
(L1/L0A/L0B) and are kept small by fixed caps instead: ``BLOCK_K * itemsize = 512`` bytes
(the cube-path alignment triton-ascend asks for), ``BLOCK_M, BLOCK_N <= 128`` and a float32
``[BLOCK_M, BLOCK_N]`` accumulator of at most 64 KiB (half the 128 KiB L0C of an Atlas A2 AI
core, double-buffered).

Grids: vector-only kernels get one program per vector core, kernels with ``tl.dot`` one per
AI core; every program loops over its rows or tiles (``range(pid, n, num_programs)``), since
triton-ascend binds programs to physical cores and runs extra programs in further rounds.

Sources: triton-ascend ``docs/en/programming_guide.md`` (UB 192 KB on A2, double buffering on
by default, grid = core count, 32-byte tail-axis alignment for vector and 512-byte for
cube-vector kernels); ``docs/sources/python-api/outline.md`` ("all tensors alive at once must
not exceed 96 KB; 192 KB with double buffering off").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .chip import ChipSpec

#: Share of the UB the estimated live set may use (the rest: the compiler's scratch).
SAFETY = 0.9
#: UB alignment of a buffer's last axis (bytes).
UB_ALIGN = 32
#: Bytes of one ``tl.dot`` operand row along K (triton-ascend's cube-path alignment).
CUBE_K_BYTES = 512
#: Largest ``BLOCK_M`` / ``BLOCK_N`` of the tile kernels, and the float32 accumulator cap.
MAX_TILE_SIDE = 128
MAX_ACC_BYTES = 64 * 1024
#: Smallest block of any axis (a 16 x 16 cube fractal; 32 bytes of 16-bit data).
MIN_BLOCK = 16
#: Largest vocabulary block of the row kernel and hidden block of the row-wise kernels.
MAX_ROW_BLOCK = 8192
#: Allowance for scalars and short per-row vectors of any kernel (bytes).
SMALL_BYTES = 1024


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _tile(rows: int, cols: int, itemsize: int) -> int:
    """UB bytes of a ``[rows, cols]`` buffer, the last axis padded to :data:`UB_ALIGN`."""
    return rows * (-(-cols * itemsize // UB_ALIGN) * UB_ALIGN)


def itemsize(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _total(buffers, multibuffer: bool) -> int:
    return (2 if multibuffer else 1) * (sum(b for _, b in buffers) + SMALL_BYTES)


def row_kernel_buffers(block_v: int, elem: int):
    """Live set of ``logits_grad_inplace_kernel`` at its peak (gradient pass with
    softcap and label smoothing): the loaded block and its float32 copy, two softcap
    temporaries, the exponential / gradient, the block cast back for the store, column
    indices and two masks."""
    return (
        ("logits block (input dtype)", _tile(1, block_v, elem)),
        ("float32 logits", _tile(1, block_v, 4)),
        ("softcap temporaries x2", 2 * _tile(1, block_v, 4)),
        ("exp / gradient", _tile(1, block_v, 4)),
        ("where temporary", _tile(1, block_v, 4)),
        ("gradient cast for store", _tile(1, block_v, elem)),
        ("column indices (int32)", _tile(1, block_v, 4)),
        ("masks x2", 2 * _tile(1, block_v, 1)),
    )


def forward_tile_buffers(block_m: int, block_n: int, elem: int):
    """Live set of ``lse_forward_kernel`` on the vector side: the float32
    logit tile from the cube, two softcap temporaries, the exponential, one ``where``
    temporary, two masks, the bias block and the per-row running statistics."""
    return (
        ("logit tile (float32, from tl.dot)", _tile(block_m, block_n, 4)),
        ("softcap temporaries x2", 2 * _tile(block_m, block_n, 4)),
        ("exp tile", _tile(block_m, block_n, 4)),
        ("where temporary", _tile(block_m, block_n, 4)),
        ("masks x2", 2 * _tile(block_m, block_n, 1)),
        ("bias block", _tile(1, block_n, 4)),
        ("row statistics x6", 6 * _tile(1, block_m, 8)),
    )


def backward_tile_buffers(block_m: int, block_n: int, block_h: int, elem: int):
    """Live set of ``dhidden_dweight_backward_kernel`` on the vector side: the
    float32 logit tile, its gradient, two softcap temporaries, the exponential, a mask, the
    gradient in the input dtype and the fresh copy fed to each ``tl.dot``, and the two float32
    products (``dz @ W`` and ``dz.T @ h``) that are added into the accumulators."""
    return (
        ("logit tile (float32, from tl.dot)", _tile(block_m, block_n, 4)),
        ("gradient tile (float32)", _tile(block_m, block_n, 4)),
        ("softcap temporaries x2", 2 * _tile(block_m, block_n, 4)),
        ("exp tile", _tile(block_m, block_n, 4)),
        ("keep mask", _tile(block_m, block_n, 1)),
        ("gradient (input dtype) + dot copy", 2 * _tile(block_m, block_n, elem)),
        ("dH product (float32)", _tile(block_m, block_h, 4)),
        ("dW product (float32)", _tile(block_n, block_h, 4)),
        ("bias / db block", 2 * _tile(1, block_n, 4)),
        ("row vectors x6", 6 * _tile(1, block_m, 8)),
    )


def rowwise_buffers(block_h: int, elem: int):
    """Live set of the row-wise ``H`` kernels (``dhidden_rows_store_kernel``,
    ``target_dweight_runs_kernel``): a float32 accumulator, two loaded rows and
    their float32 copies, the destination row and its copy, the cast for the store, column
    indices and a mask."""
    return (
        ("float32 accumulator", _tile(1, block_h, 4)),
        ("loaded rows x3 (input dtype)", 3 * _tile(1, block_h, elem)),
        ("float32 copies x3", 3 * _tile(1, block_h, 4)),
        ("row cast for store", _tile(1, block_h, elem)),
        ("column indices (int32)", _tile(1, block_h, 4)),
        ("mask", _tile(1, block_h, 1)),
    )


@dataclass(frozen=True)
class RowPlan:
    """A vector kernel over rows: block of the looped axis, grid, estimated UB bytes."""

    block: int
    grid: int
    ub_bytes: int


@dataclass(frozen=True)
class TilePlan:
    """A ``tl.dot`` kernel over (row block, vocabulary tile) tasks."""

    block_m: int
    block_n: int
    block_k: int
    block_h: int  # 0 for the forward kernel
    splits: int  # vocabulary splits of the forward kernel (1 for the backward)
    grid: int
    ub_bytes: int


@dataclass(frozen=True)
class LaunchConfig:
    """Every ascend kernel's launch for one problem shape on one chip.

    Attributes:
        chip: the chip it was derived for.
        ub_budget: bytes the estimated live set of any kernel may take.
        rows: ``logits_grad_inplace_kernel`` (``block`` = ``BLOCK_V``).
        forward: ``lse_forward_kernel``.
        backward: ``dhidden_dweight_backward_kernel``.
        rowwise: ``dhidden_rows_store_kernel`` and
            ``target_dweight_runs_kernel`` (``block`` = ``BLOCK_H``).
    """

    chip: ChipSpec
    ub_budget: int
    rows: RowPlan
    forward: TilePlan
    backward: TilePlan
    rowwise: RowPlan

    @property
    def ub_bytes(self) -> int:
        """The largest estimated UB live set of the four kernels (bytes)."""
        return max(self.rows.ub_bytes, self.forward.ub_bytes, self.backward.ub_bytes,
                   self.rowwise.ub_bytes)  # fmt: skip


def ub_budget(chip: ChipSpec) -> int:
    """Bytes of UB the estimated live set of one kernel may use on ``chip``."""
    return int(chip.ub_bytes * SAFETY)


def _largest_block(limit: int, cost, budget: int) -> int:
    """Largest power of two ``b`` in ``[MIN_BLOCK, limit]`` with ``cost(b) <= budget``
    (``MIN_BLOCK`` if none fits: the smallest legal block)."""
    b = max(MIN_BLOCK, _pow2_floor(limit))
    while b > MIN_BLOCK and cost(b) > budget:
        b //= 2
    return b


def _tile_candidates(m_cap: int, n_cap: int):
    """``(block_m, block_n)`` powers of two within the caps, best first: larger area, then
    closer to square (equal sides minimise ``W`` and ``hidden`` re-reads for a given area),
    then the larger vocabulary side."""
    sides = [1 << k for k in range(MIN_BLOCK.bit_length() - 1, MAX_TILE_SIDE.bit_length())]
    pairs = [
        (m, n)
        for m in sides
        for n in sides
        if m <= m_cap and n <= n_cap and m * n * 4 <= MAX_ACC_BYTES
    ]
    return sorted(pairs, key=lambda p: (-p[0] * p[1], abs(p[0].bit_length() - p[1].bit_length()),
                                        -p[1]))  # fmt: skip


@functools.lru_cache(maxsize=256)
def launch_config(n_rows: int, hidden: int, vocab: int, dtype: torch.dtype,
                  chip: ChipSpec) -> LaunchConfig:  # fmt: skip
    """Block sizes, grids and estimated UB bytes of every ascend kernel for one problem.

    Args:
        n_rows: counted rows ``N`` the kernels will see (>= 0).
        hidden: hidden size ``H``.
        vocab: vocabulary size ``V``.
        dtype: input dtype (float16, bfloat16 or float32).
        chip: the chip (:func:`~.chip.detect_chip`).

    Returns:
        A :class:`LaunchConfig` whose every kernel's estimated UB live set is within
        :func:`ub_budget` (unless even the smallest legal blocks exceed it, which no Ascend
        chip's 192 KB UB comes near).
    """
    elem = itemsize(dtype)
    mb = chip.multibuffer
    budget = ub_budget(chip)
    n_rows = max(int(n_rows), 1)

    # Row kernel (chunked path): one vocabulary block per step, vector cores.
    block_v = _largest_block(
        min(MAX_ROW_BLOCK, _pow2_ceil(vocab)),
        lambda b: _total(row_kernel_buffers(b, elem), mb),
        budget,
    )
    rows = RowPlan(block_v, min(chip.vectorcores, n_rows),
                   _total(row_kernel_buffers(block_v, elem), mb))  # fmt: skip

    # Tile kernels (zero-logits path): AI cores.
    block_k = max(MIN_BLOCK, min(CUBE_K_BYTES // elem, _pow2_ceil(hidden)))
    m_cap = max(MIN_BLOCK, _pow2_ceil(n_rows))
    n_cap = max(MIN_BLOCK, _pow2_ceil(vocab))
    fwd = None
    for bm, bn in _tile_candidates(m_cap, n_cap):
        cost = _total(forward_tile_buffers(bm, bn, elem), mb)
        if cost <= budget:
            fwd = (bm, bn, cost)
            break
    if fwd is None:
        fwd = (MIN_BLOCK, MIN_BLOCK, _total(forward_tile_buffers(MIN_BLOCK, MIN_BLOCK, elem), mb))
    bm, bn, cost = fwd
    row_blocks = -(-n_rows // bm)
    vocab_tiles = -(-vocab // bn)
    # Enough (row block, split) tasks to give every AI core work.
    splits = max(1, min(vocab_tiles, -(-chip.aicores // row_blocks)))
    forward = TilePlan(bm, bn, block_k, 0, splits, min(chip.aicores, row_blocks * splits), cost)

    bwd = None
    h_cap = max(MIN_BLOCK, min(256, _pow2_ceil(hidden)))
    for bm, bn in _tile_candidates(m_cap, n_cap):
        bh = _largest_block(
            h_cap, lambda b, bm=bm, bn=bn: _total(backward_tile_buffers(bm, bn, b, elem), mb),
            budget,
        )
        cost = _total(backward_tile_buffers(bm, bn, bh, elem), mb)
        # Keep the H loop short: a product block of at least 64 (or all of H).
        if cost <= budget and bh >= min(64, h_cap):
            bwd = (bm, bn, bh, cost)
            break
    if bwd is None:
        bwd = (MIN_BLOCK, MIN_BLOCK, MIN_BLOCK,
               _total(backward_tile_buffers(MIN_BLOCK, MIN_BLOCK, MIN_BLOCK, elem), mb))
    bm, bn, bh, cost = bwd
    tasks = -(-n_rows // bm) * -(-vocab // bn)
    backward = TilePlan(bm, bn, block_k, bh, 1, min(chip.aicores, tasks), cost)

    block_h = _largest_block(
        min(MAX_ROW_BLOCK, _pow2_ceil(hidden)),
        lambda b: _total(rowwise_buffers(b, elem), mb),
        budget,
    )
    rowwise = RowPlan(block_h, min(chip.vectorcores, n_rows),
                      _total(rowwise_buffers(block_h, elem), mb))  # fmt: skip
    return LaunchConfig(chip, budget, rows, forward, backward, rowwise)

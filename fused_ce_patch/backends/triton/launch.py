"""Launch settings, host-side helpers and the launchers of backend ``"triton"``.

The two drivers (:mod:`.chunked_path`, :mod:`.zero_logits`) call their kernels only through a
*launcher* object (:class:`Launchers`): :data:`CUDA_LAUNCHERS` (this module, the default) runs
the kernels of :mod:`.kernels` with the block sizes below and the CUDA settings of their
device switches; backend ``"ascend"`` passes its own (``ascend/launch.py``), which runs the
same kernels with persistent grids and blocks sized for the NPU.
Everything else in the drivers (matmuls, chunking, accumulators, roundings) is shared.

Block sizes are chosen per device: a CUDA GPU gets sizes checked on an H200 (BENCHMARKS.md,
"## GPU"); CPU tensors, which only the Triton interpreter (``TRITON_INTERPRET=1``, used by CI)
runs, get small legal sizes and no software pipelining, since it runs every program in Python.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..base import LossSpec
from .kernels import (
    dhidden_dweight_backward_kernel,
    dhidden_rows_store_kernel,
    grad_tma_kernel,
    logits_grad_cols_kernel,
    logits_grad_inplace_kernel,
    lse_cols_kernel,
    lse_forward_kernel,
    lse_merge_kernel,
    lse_tma_kernel,
    lse_tma_runs_kernel,
    scale_unless_one_kernel,
    target_dweight_kernel,
)


@dataclass(frozen=True)
class RowKernelConfig:
    """Launch of :func:`logits_grad_inplace_kernel` (one program per row)."""

    block_v: int
    num_warps: int
    num_stages: int = 3
    #: LSE pass over ``[sub_rows, block_v / sub_rows]`` tiles, a running max per segment
    #: (``kernels._lse_step_rows``); 1: one max per block.
    sub_rows: int = 1
    #: PTX ``ex2``/``rcp`` approximations with subnormals flushed (kernels module docstring,
    #: ``FAST_MATH``); NVIDIA GPUs only.
    fast_math: bool = False


@dataclass(frozen=True)
class TileConfig:
    """Launch of the zero-logits kernels (``lse_forward`` / ``dhidden_dweight_backward``)."""

    block_m: int
    block_n: int
    block_k: int
    block_h: int
    num_warps: int
    num_stages: int


def row_kernel_config(vocab: int, device: torch.device) -> RowKernelConfig:
    if device.type != "cuda":
        return RowKernelConfig(block_v=min(1024, _pow2(vocab)), num_warps=4, num_stages=1)
    block_v = min(4096, _pow2(vocab))
    # 16 segments of 256 logits a step, each max reduced within its warp: on an H200 the row
    # kernel's LSE pass was 2-17 % faster than with one block-wide max a step (most with
    # softcap), the whole loss ~0.8 % (BENCHMARKS.md, 2026-12-01 afternoon)
    sub_rows = 16 if block_v >= 4096 else 1
    return RowKernelConfig(block_v=block_v, num_warps=8, num_stages=3, sub_rows=sub_rows,
                           fast_math=nvidia_ptx(device))


def stats_kernel_config(vocab: int, device: torch.device, softcap: bool) -> RowKernelConfig:
    """Launch of :func:`~.stats_kernels.token_stats_row_kernel` (one program per row)."""
    if device.type != "cuda":
        return row_kernel_config(vocab, device)
    # 8 segments of 256 a step; 4 warps (8 with softcap): on an H200 the SFT statistics
    # (entropy, top-1, gradient in one launch) of one chunk ran 7-15 % faster than at 4096
    # columns in 16 segments and 8 warps (the loss kernel's launch), where the per-lane
    # accumulators take 220 registers a thread (BENCHMARKS.md, 2026-12-03 08:00)
    block_v = min(2048, _pow2(vocab))
    return RowKernelConfig(block_v=block_v, num_warps=8 if softcap else 4, num_stages=3,
                           sub_rows=8 if block_v >= 2048 else 1,
                           fast_math=nvidia_ptx(device))


def nvidia_ptx(device: torch.device) -> bool:
    """Whether Triton compiles for ``device`` through NVIDIA's PTX (CUDA, not ROCm), so that
    kernels may carry inline PTX."""
    return device.type == "cuda" and torch.version.hip is None


#: Shared memory per block (bytes; LDS on ROCm) from which the 16-bit zero-logits kernels get
#: 128 x 256 tiles. Compiled by Triton 3.9 they need 144 KiB on sm_90; 96 KiB (forward) and
#: 120 KiB (backward) on sm_80-sm_120; 96 KiB (forward) on gfx942: more than the 99 KiB of
#: sm_86/sm_89/sm_120 (A10, L4, L40S, RTX 30xx-50xx) or the 64 KiB of MI300, where the launch
#: would raise ``OutOfResources``. 128 x 128 needs at most 96 KiB there (64 KiB on gfx942).
#: H100/H200 (227 KiB), A100 (163 KiB) and MI355 (160 KiB) pass; tests/backends/
#: test_triton_tiles.py compiles the chosen tiles for these targets.
WIDE_TILE_MIN_SHARED_MEM = 160 * 1024


@functools.lru_cache(maxsize=None)
def _max_shared_mem_of(index: int) -> int:
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def max_shared_mem(device: torch.device) -> int:
    """Shared memory (bytes; LDS on ROCm) one block may use on the CUDA/ROCm ``device``: the
    opt-in limit Triton checks each launch against (its driver's ``max_shared_mem``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _max_shared_mem_of(index)


def forward_tile_config(dtype: torch.dtype, device: torch.device) -> TileConfig:
    if device.type != "cuda":
        return TileConfig(16, 32, 32, 32, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return TileConfig(64, 64, 32, 64, num_warps=4, num_stages=3)
    if max_shared_mem(device) >= WIDE_TILE_MIN_SHARED_MEM:
        # 128 x 256 logit tiles: forward 15-29 % faster than 128 x 128 on an H200 at every
        # benchmark shape (BENCHMARKS.md, 2026-12-01 evening; benchmarks/gpu_zero_tiles.py)
        return TileConfig(128, 256, 64, 64, num_warps=8, num_stages=3)
    return TileConfig(128, 128, 64, 64, num_warps=8, num_stages=3)


def backward_tile_config(dtype: torch.dtype, device: torch.device,
                         hidden_size: int | None = None) -> TileConfig:  # fmt: skip
    if device.type != "cuda":
        return TileConfig(16, 32, 32, 32, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return TileConfig(64, 64, 32, 64, num_warps=4, num_stages=2)
    if (hidden_size is not None and hidden_size <= 1024
            and max_shared_mem(device) >= WIDE_TILE_MIN_SHARED_MEM):  # fmt: skip
        # narrow hidden states: 256-column tiles halve dH's atomics, 12 % faster at Gemma-3
        # (H = 640) on an H200; at H = 2304-4096 the same tiles were 6-25 % slower (register
        # pressure), so wider models keep 128 x 128 (gpu_zero_tiles.py)
        return TileConfig(128, 256, 64, 32, num_warps=8, num_stages=2)
    return TileConfig(128, 128, 64, 64, num_warps=8, num_stages=2)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision for float32 operands: follows torch's own matmul setting, so
    float32 stays IEEE float32 unless the user allowed TF32 (``allow_tf32`` or
    ``set_float32_matmul_precision("high"/"medium")``). 16-bit operands ignore it."""
    if dtype == torch.float32 and (
        torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    ):
        return "tf32"
    return "ieee"


def _pow2(n: int) -> int:
    return 1 << max(4, (int(n) - 1).bit_length())


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def scale_args(scale, device: torch.device):
    """``(SCALE_MODE, scale_tensor, scale_value)`` for a Python float, a 0-d tensor or an
    ``[r]`` tensor (float32 on ``device``)."""
    if isinstance(scale, torch.Tensor):
        t = scale.to(device=device, dtype=torch.float32)
        if t.dim() == 0:
            return 1, t, 0.0
        return 2, t.contiguous(), 0.0
    dummy = torch.empty(1, dtype=torch.float32, device=device)
    return 0, dummy, float(scale)


def row_offsets(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Element offsets (int64) of the flat rows ``rows`` of ``hidden [..., H]`` in its storage
    (relative to ``hidden.data_ptr()``), for any strides; no copy of ``hidden``."""
    offs = torch.zeros_like(rows)
    rem = rows
    for size, stride in zip(reversed(hidden.shape[:-1]), reversed(hidden.stride()[:-1])):
        offs = offs + (rem % size) * stride
        rem = rem // size
    return offs


def row_align(hidden: torch.Tensor) -> int:
    """Largest of 16, 8, 4, 2, 1 that divides every row offset of ``hidden [..., H]`` (its
    leading strides), for ``tl.multiple_of`` hints on gathered row loads."""
    align = 16
    for size, stride in zip(hidden.shape[:-1], hidden.stride()[:-1]):
        while align > 1 and size > 1 and stride % align:
            align //= 2
    return align if hidden.stride(-1) == 1 else 1


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Launchers(Protocol):
    """The kernels the two drivers need, each launched over whole tensors.

    Every tensor argument is on the device of ``hidden``; "counted rows" are the rows whose
    label is not ignored (``M`` of them), float32 unless stated. Methods never synchronise
    with the device unless their docstring says so.
    """

    def logits_grad(self, z, labels, lse, nll, loss, coef, scale, spec: LossSpec, *,
                    compute_lse: bool, write_grad: bool) -> None:  # fmt: skip
        """Chunked path, per ``[r, V]`` logits chunk ``z`` (input dtype, bias included).

        ``compute_lse``: write ``lse``, ``nll`` (``LSE - z_y`` without rounding LSE first)
        and ``loss`` (``[r]``); otherwise read ``lse`` and ``nll``. ``write_grad``: overwrite
        ``z`` with ``scale * dL/dz`` (0 in each row's target column) and write the target
        column's value to ``coef`` ``[r]``, with ``p_y`` from ``nll`` (``1 - p_y = -expm1(-nll)``
        when ``p_y > 1/2``). ``scale``: a float, a
        0-d or an ``[r]`` float32 tensor; ``loss``/``coef`` may be None when not written.
        """

    def scale_unless_one(self, tensors, g: torch.Tensor) -> None:
        """``t *= g`` for each contiguous tensor of ``tensors`` (None skipped), unless the 0-d
        float ``g`` (the upstream gradient of a scalar loss) is 1. CUDA reads ``g`` on the
        device (no synchronisation)."""

    def dhidden_rows(self, dh, out_rows, *, part=None, coef=None, labels=None, weight=None,
                     accumulate: bool = False) -> None:  # fmt: skip
        """``dH[out_rows] (+)= part + coef * W[labels]`` in float32, rounded once into ``dh``
        ``[N, H]``; ``part`` ``[r, H]`` any float dtype; ``coef``, ``labels`` ``[r]``."""

    def sort_by_label(self, labels) -> Any:
        """Counted rows grouped by label, as :meth:`target_dweight` takes them (computed once
        per backward, reused for each vocabulary group)."""

    def target_dweight(self, dw, db, labels, coef, hidden, row_off, *, v_lo: int = 0,
                       v_hi: int | None = None, by_label=None) -> None:  # fmt: skip
        """``dW[y - v_lo] += sum_{r: y_r = y} coef_r * h_r`` and ``db[y] += sum coef_r`` for
        the labels ``y`` in ``[v_lo, v_hi)`` (all when ``v_hi`` is None), one rounding per
        row of ``dw`` (the rows ``[v_lo, v_hi)`` of dW, any float dtype, or None); ``db``
        float32 ``[V]`` or None; ``labels``, ``coef``, ``row_off`` ``[M]``; ``by_label``
        from :meth:`sort_by_label` (computed here when None)."""

    def lse_forward_partials(self, hidden, row_off, weight, bias, labels,
                             spec: LossSpec) -> torch.Tensor:  # fmt: skip
        """Zero-logits forward: ``[4, splits, M]`` partial statistics of the ``M >= 1``
        counted rows at ``row_off`` over splits of the vocabulary: running max, sum of exp
        relative to it, the (softcapped) target logit where it lies in the split else 0, the
        sum of (softcapped) logits."""

    def backward_block_m(self, weight) -> int:
        """Rows per tile of :meth:`dhidden_dweight_backward` (row groups are multiples)."""

    def dhidden_dweight_backward(self, hidden, row_off, weight, bias, labels, lse, scale,
                                 dh_acc, dw_acc, db, v_start: int, n_cols: int,
                                 spec: LossSpec) -> None:  # fmt: skip
        """Zero-logits backward for the ``r = len(labels)`` counted rows at ``row_off``
        against the vocabulary columns ``[v_start, v_start + n_cols)``: recompute the logits,
        add the products of ``scale * dL/dz`` without the target column into ``dh_acc``
        (``[>= r, H]``), ``dw_acc`` (``[n_cols, H]``) and ``db`` (``[V]``), each float32 or
        None. ``scale``: a 0-d or an ``[r]`` float32 tensor."""

    # Optional (the CUDA launchers have it; launchers without it keep the zero-logits path
    # on :meth:`dhidden_dweight_backward`): ``logits_grad_cols(z, g, bias, labels, lse,
    # p_scale, scale, v0, vocab, spec)``, the in-place backward's gradient of one vocabulary
    # chunk of float32 logits ``z [N, c]`` (:func:`~.kernels.logits_grad_cols_kernel`);
    # ``lse_cols(z, bias, labels, state, v0, spec)``, the zero-logits forward's merge of one
    # such chunk into the rows' running LSE (:func:`~.kernels.lse_cols_kernel`; launchers
    # without it keep the forward on ``lse_forward_partials``); ``lse_tma(h2, weight, bias,
    # labels, state, spec)``, the zero-logits forward of every row as one Triton GEMM with the
    # LSE in its epilogue, where :func:`tma_device` holds (:func:`~.kernels.lse_tma_kernel`);
    # ``grad_tma(h2, weight, g, bias, labels, lse, p_scale, scale, v0, spec)``, the in-place
    # backward's chunk gradient straight from the operands, one GEMM with the gradient in its
    # epilogue (:func:`~.kernels.grad_tma_kernel`; launchers without it keep float32 logits
    # and ``logits_grad_cols``).


def _flags(spec: LossSpec) -> dict:
    """The loss options' compile-time switches."""
    return dict(
        HAS_SOFTCAP=spec.softcap is not None,
        SMOOTHING=spec.label_smoothing != 0.0,
        Z_LOSS=spec.z_loss != 0.0,
    )


def launch_logits_grad(grid, z, labels, lse, nll, loss, coef, scale, spec: LossSpec, *,
                       compute_lse: bool, write_grad: bool, **settings) -> None:  # fmt: skip
    """:func:`~.kernels.logits_grad_inplace_kernel` over the ``[r, V]`` chunk ``z``, with the
    grid and the launch settings (``BLOCK_V``, device switches, warps) of the caller's
    launchers; the other arguments as in :meth:`Launchers.logits_grad`."""
    r, vocab = z.shape
    mode, scale_t, scale_v = scale_args(scale if write_grad else 1.0, z.device)
    logits_grad_inplace_kernel[grid](
        z, z.stride(0), labels, lse, nll,
        loss if loss is not None else lse,
        coef if coef is not None else lse,
        scale_t, scale_v, r, vocab,
        float(spec.softcap or 1.0), float(spec.label_smoothing), float(spec.z_loss),
        **_flags(spec),
        SCALE_MODE=mode,
        COMPUTE_LSE=compute_lse,
        WRITE_GRAD=write_grad,
        **settings,
    )  # fmt: skip


def launch_dhidden_rows(grid, dh, out_rows, part, coef, labels, weight, accumulate: bool,
                        **settings) -> None:  # fmt: skip
    """:func:`~.kernels.dhidden_rows_store_kernel` (see :meth:`Launchers.dhidden_rows`)."""
    w = weight if weight is not None else dh
    dhidden_rows_store_kernel[grid](
        dh, dh.stride(0),
        part if part is not None else dh,
        part.stride(0) if part is not None else 0,
        out_rows,
        coef if coef is not None else out_rows,
        labels if labels is not None else out_rows,
        w, w.stride(0), w.stride(1),
        out_rows.shape[0], dh.shape[1],
        HAS_PART=part is not None,
        ADD_TARGET=coef is not None,
        ACCUMULATE=accumulate,
        **settings,
    )  # fmt: skip


def launch_lse_forward(grid, hidden, row_off, weight, bias, labels, part, per_split: int,
                       spec: LossSpec, **settings) -> None:  # fmt: skip
    """:func:`~.kernels.lse_forward_kernel` into ``part`` ``[4, splits, M]`` (see
    :meth:`Launchers.lse_forward_partials`)."""
    vocab, hsize = weight.shape
    lse_forward_kernel[grid](
        hidden, row_off, hidden.stride(-1),
        weight, weight.stride(0), weight.stride(1),
        bias if bias is not None else weight,
        labels, part, labels.shape[0], vocab, hsize, part.shape[1], per_split,
        float(spec.softcap or 1.0),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=spec.softcap is not None,
        SMOOTHING=spec.label_smoothing != 0.0,
        EVEN_K=hsize % settings["BLOCK_K"] == 0,
        **settings,
    )  # fmt: skip


def launch_dhidden_dweight_backward(grid, hidden, row_off, weight, bias, labels, lse, scale,
                                    dh_acc, dw_acc, db, v_start: int, n_cols: int,
                                    spec: LossSpec, **settings) -> None:  # fmt: skip
    """:func:`~.kernels.dhidden_dweight_backward_kernel` (see
    :meth:`Launchers.dhidden_dweight_backward`)."""
    vocab, hsize = weight.shape
    mode, scale_t, scale_v = scale_args(scale, hidden.device)
    dummy = lse  # float32, like the accumulators it stands in for
    dhidden_dweight_backward_kernel[grid](
        hidden, row_off, hidden.stride(-1),
        weight, weight.stride(0), weight.stride(1),
        bias if bias is not None else weight,
        labels, lse, scale_t, scale_v,
        dh_acc if dh_acc is not None else dummy,
        dw_acc if dw_acc is not None else dummy,
        db if db is not None else dummy,
        labels.shape[0], v_start, n_cols, vocab, hsize,
        float(spec.softcap or 1.0), float(spec.label_smoothing), float(spec.z_loss),
        HAS_BIAS=bias is not None,
        **_flags(spec),
        SCALE_MODE=mode,
        NEED_H=dh_acc is not None,
        NEED_W=dw_acc is not None,
        NEED_B=db is not None,
        EVEN_K=hsize % settings["BLOCK_K"] == 0,
        **settings,
    )  # fmt: skip


class CudaLaunchers:
    """:class:`Launchers` with the kernels of :mod:`.kernels` and their CUDA switches: CUDA/ROCm
    tensors, or CPU tensors under the interpreter. Stateless; settings come from the
    functions above."""

    def logits_grad(self, z, labels, lse, nll, loss, coef, scale, spec, *, compute_lse,
                    write_grad):  # fmt: skip
        r, vocab = z.shape
        if r == 0:
            return
        cfg, programs = self._row_launch(vocab, z.device)
        launch_logits_grad(
            (min(r, programs) if programs else r,), z, labels, lse, nll, loss, coef, scale,
            spec, compute_lse=compute_lse, write_grad=write_grad,
            BLOCK_V=cfg.block_v, FIX_RNE=z.device.type == "cpu", NUM_STAGES=cfg.num_stages,
            LANE_SUMS=True, PERSISTENT=bool(programs), SUB_ROWS=cfg.sub_rows,
            FAST_MATH=cfg.fast_math, num_warps=cfg.num_warps,
        )  # fmt: skip

    def _row_launch(self, vocab: int, device: torch.device) -> tuple[RowKernelConfig, int]:
        """The row kernel's settings and its number of programs (0: one per row)."""
        return row_kernel_config(vocab, device), 0

    def scale_unless_one(self, tensors, g):
        g = g.reshape(()).to(torch.float32)
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            if not t.is_contiguous():
                raise ValueError("scale_unless_one: tensors must be contiguous")
            block = 4096 if t.device.type == "cuda" else 1024
            programs = min(triton_cdiv(t.numel(), block), 4 * num_sms(t.device))
            scale_unless_one_kernel[(programs,)](
                t, t.numel(), g, BLOCK=block, FIX_RNE=t.device.type == "cpu", num_warps=4
            )

    def dhidden_rows(self, dh, out_rows, *, part=None, coef=None, labels=None, weight=None,
                     accumulate=False):  # fmt: skip
        r = out_rows.shape[0]
        hsize = dh.shape[1]
        if r == 0:
            return
        block_h = min(1024 if dh.device.type == "cuda" else 256, _pow2(hsize))
        launch_dhidden_rows(
            (r, triton_cdiv(hsize, block_h)), dh, out_rows, part, coef, labels, weight,
            accumulate, BLOCK_H=block_h, FIX_RNE=dh.device.type == "cpu", PERSISTENT=False,
            num_warps=4,
        )  # fmt: skip

    def sort_by_label(self, labels):
        """``torch.sort(labels, stable=True)``: sorted labels and each one's row index."""
        return torch.sort(labels, stable=True)

    def target_dweight(self, dw, db, labels, coef, hidden, row_off, *, v_lo=0, v_hi=None,
                       by_label=None):  # fmt: skip
        m = labels.shape[0]
        if m == 0 or (dw is None and db is None):
            return
        if by_label is None:
            by_label = self.sort_by_label(labels)
        sorted_labels, order = by_label
        hsize = hidden.shape[-1]
        block_h = min(1024 if hidden.device.type == "cuda" else 256, _pow2(hsize))
        n_hblocks = triton_cdiv(hsize, block_h) if dw is not None else 1
        target_dweight_kernel[(m, n_hblocks)](
            dw if dw is not None else coef,
            dw.stride(0) if dw is not None else 0,
            db if db is not None else coef,
            sorted_labels,
            order,
            coef,
            hidden,
            row_off,
            hidden.stride(-1),
            m,
            hsize,
            v_lo,
            v_hi if v_hi is not None else 2**62,
            NEED_W=dw is not None,
            NEED_B=db is not None,
            BLOCK_H=block_h,
            FIX_RNE=hidden.device.type == "cpu",
            num_warps=4,
        )

    def lse_forward_partials(self, hidden, row_off, weight, bias, labels, spec):
        m = labels.shape[0]
        vocab = weight.shape[0]
        dev = hidden.device
        cfg = forward_tile_config(weight.dtype, dev)
        row_blocks = triton_cdiv(m, cfg.block_m)
        splits = max(1, min(triton_cdiv(vocab, cfg.block_n),
                            triton_cdiv(2 * num_sms(dev), row_blocks)))  # fmt: skip
        per_split = triton_cdiv(triton_cdiv(vocab, splits), cfg.block_n) * cfg.block_n
        splits = triton_cdiv(vocab, per_split)
        part = torch.empty(4, splits, m, dtype=torch.float32, device=dev)
        launch_lse_forward(
            (row_blocks, splits), hidden, row_off, weight, bias, labels, part, per_split, spec,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            DOT_PRECISION=dot_precision(weight.dtype), UPCAST=dev.type == "cpu",
            ROW_ALIGN=row_align(hidden), PERSISTENT=False,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return part

    def backward_block_m(self, weight):
        return backward_tile_config(weight.dtype, weight.device, weight.shape[1]).block_m

    def dhidden_dweight_backward(self, hidden, row_off, weight, bias, labels, lse, scale,
                                 dh_acc, dw_acc, db, v_start, n_cols, spec):  # fmt: skip
        dev = hidden.device
        tc = backward_tile_config(weight.dtype, dev, weight.shape[1])
        grid = (triton_cdiv(labels.shape[0], tc.block_m), triton_cdiv(n_cols, tc.block_n))
        launch_dhidden_dweight_backward(
            grid, hidden, row_off, weight, bias, labels, lse, scale, dh_acc, dw_acc, db,
            v_start, n_cols, spec,
            BLOCK_M=tc.block_m, BLOCK_N=tc.block_n, BLOCK_K=tc.block_k, BLOCK_H=tc.block_h,
            DOT_PRECISION=dot_precision(weight.dtype), UPCAST=dev.type == "cpu",
            FIX_RNE=dev.type == "cpu", ROW_ALIGN=row_align(hidden), FRESH_OPERANDS=False,
            ATOMIC_SEM="relaxed", PERSISTENT=False,
            num_warps=tc.num_warps, num_stages=tc.num_stages,
        )  # fmt: skip

    def logits_grad_cols(self, z, g, bias, labels, lse, p_scale, scale, v0, vocab, spec):
        """:func:`~.kernels.logits_grad_cols_kernel`: float32 logits ``z [N, c]`` of the
        vocabulary columns ``[v0, v0 + c)`` to the input-dtype gradient ``g [N, c]`` (which
        may overlay ``z``, row by row); ``bias`` ``[V]`` or None; ``labels`` int64 (< 0: row
        not counted), ``lse``, ``p_scale``, ``scale`` float32 ``[N]``."""
        n, c = z.shape
        if n == 0 or c == 0:
            return
        if z.device.type == "cuda":
            block_r, block_c, warps = GRAD_COLS_LAUNCH
        else:
            block_r, block_c, warps = 4, 32, 4
        logits_grad_cols_kernel[(triton_cdiv(n, block_r),)](
            z, z.stride(0), g, g.stride(0), bias if bias is not None else z, labels, lse,
            p_scale, scale, n, c, v0, vocab,
            float(spec.softcap or 1.0), float(spec.label_smoothing),
            HAS_BIAS=bias is not None, HAS_SOFTCAP=spec.softcap is not None,
            SMOOTHING=spec.label_smoothing != 0.0,
            BLOCK_R=block_r, BLOCK_C=block_c, FIX_RNE=z.device.type == "cpu",
            FAST_MATH=ZERO_FAST_MATH and nvidia_ptx(z.device), num_warps=warps,
        )  # fmt: skip

    def lse_cols(self, z, bias, labels, state, v0, spec):
        """:func:`~.kernels.lse_cols_kernel`: merge float32 logits ``z [N, c]`` of the
        vocabulary columns ``[v0, v0 + c)`` into the running LSE state ``state`` (float32
        ``[4, N]``); ``bias`` ``[V]`` or None; ``labels`` int64 ``[N]`` (< 0: no target)."""
        n, c = z.shape
        if n == 0 or c == 0:
            return
        if z.device.type == "cuda":
            block_r, block_c, warps = LSE_COLS_LAUNCH
        else:
            block_r, block_c, warps = 4, 32, 4
        lse_cols_kernel[(triton_cdiv(n, block_r),)](
            z, z.stride(0), bias if bias is not None else z, labels, state, n, c, v0,
            float(spec.softcap or 1.0),
            HAS_BIAS=bias is not None, HAS_SOFTCAP=spec.softcap is not None,
            SMOOTHING=spec.label_smoothing != 0.0, BLOCK_R=block_r, BLOCK_C=block_c,
            FAST_MATH=ZERO_FAST_MATH and nvidia_ptx(z.device), num_warps=warps,
        )  # fmt: skip

    def lse_tma(self, h2, weight, bias, labels, state, spec, runs=None):
        """Merge every row of ``h2 [N, H]`` over the whole vocabulary into the running LSE
        state ``state`` (float32 ``[4, N]``, as :meth:`lse_cols` keeps it): per vocabulary
        slice, :func:`~.kernels.lse_tma_kernel` (the logits GEMM with the statistics in its
        epilogue; 16-bit ``h2`` and ``weight`` with 16-byte aligned rows, on a
        :func:`tma_device`) into per-block partials of at most :data:`TMA_PART_BYTES`, then
        :func:`~.kernels.lse_merge_kernel`; beyond :data:`TMA_RUNS_MIN_ROWS_PER_HIDDEN` rows
        per hidden unit, the whole vocabulary in one launch of
        :func:`~.kernels.lse_tma_runs_kernel` (a partial per run of column blocks, as many runs
        as those bytes hold). ``labels`` int64 ``[N]`` (< 0: no target). Beyond
        ``TMA_PART_BYTES / 16`` rows, groups of rows run one after another (``runs``: the
        kernel the whole of ``h2`` chose, passed to its groups)."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        n, hsize = h2.shape
        vocab = weight.shape[0]
        dev = h2.device
        if n == 0 or vocab == 0:
            return
        if runs is None:
            runs = n > TMA_RUNS_MIN_ROWS_PER_HIDDEN * hsize
        if n * TMA_PART_ROW_BLOCK_BYTES > TMA_PART_BYTES:
            # more rows than one block of partials allows: groups of rows, each its own pass
            step = TMA_PART_BYTES // TMA_PART_ROW_BLOCK_BYTES
            for r0 in range(0, n, step):
                rows = slice(r0, r0 + step)
                part_state = state[:, rows].contiguous()  # the kernels read [4, rows] planes
                self.lse_tma(h2[rows], weight, bias, labels[rows], part_state, spec, runs)
                state[:, rows] = part_state
            return
        cuda = dev.type == "cuda"
        bm, bn, bk, stages, warps = TMA_FORWARD_TILES if cuda else (16, 32, 16, 1, 4)
        blocks = max(1, min(TMA_PART_BYTES // (TMA_PART_ROW_BLOCK_BYTES * n),
                            triton_cdiv(vocab, bn)))  # fmt: skip
        part = torch.empty(4 * blocks * n, dtype=torch.float32, device=dev)
        h_desc = TensorDescriptor.from_tensor(h2, [bm, bk])
        w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
        smoothing = spec.label_smoothing != 0.0
        if runs:
            # the whole vocabulary in one launch: runs of column blocks, one partial per run
            run_tiles = triton_cdiv(triton_cdiv(vocab, bn), blocks)
            n_runs = triton_cdiv(triton_cdiv(vocab, bn), run_tiles)
            programs = min(triton_cdiv(n, bm) * n_runs, num_sms(dev) if cuda else 3)
            lse_tma_runs_kernel[(programs,)](
                h_desc, w_desc, bias if bias is not None else h2, labels, part, n, vocab, 0,
                hsize, float(spec.softcap or 1.0), programs, run_tiles,
                HAS_BIAS=bias is not None, HAS_SOFTCAP=spec.softcap is not None,
                SMOOTHING=smoothing, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                WARP_SPECIALIZE=TMA_WARP_SPECIALIZE and cuda,
                FAST_MATH=ZERO_FAST_MATH and nvidia_ptx(dev), UPCAST=not cuda,
                num_stages=stages, num_warps=warps,
            )  # fmt: skip
            block_r, block_t = (128, 8) if cuda else (16, 4)
            lse_merge_kernel[(triton_cdiv(n, block_r),)](
                part, state, n, n_runs, SMOOTHING=smoothing, BLOCK_R=block_r, BLOCK_T=block_t,
                num_warps=4,
            )  # fmt: skip
            return
        for v0 in range(0, vocab, blocks * bn):
            cols = min(blocks * bn, vocab - v0)
            n_blocks = triton_cdiv(cols, bn)
            tiles = triton_cdiv(n, bm) * n_blocks
            programs = min(tiles, num_sms(dev) if cuda else 3)
            lse_tma_kernel[(programs,)](
                h_desc, w_desc, bias if bias is not None else h2, labels, part, n, cols, v0,
                hsize, float(spec.softcap or 1.0), programs,
                HAS_BIAS=bias is not None, HAS_SOFTCAP=spec.softcap is not None,
                SMOOTHING=smoothing, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                WARP_SPECIALIZE=TMA_WARP_SPECIALIZE and cuda,
                FAST_MATH=ZERO_FAST_MATH and nvidia_ptx(dev), UPCAST=not cuda,
                num_stages=stages, num_warps=warps,
            )  # fmt: skip
            block_r, block_t = (128, 8) if cuda else (16, 4)
            lse_merge_kernel[(triton_cdiv(n, block_r),)](
                part, state, n, n_blocks, SMOOTHING=smoothing, BLOCK_R=block_r,
                BLOCK_T=block_t, num_warps=4,
            )  # fmt: skip

    def grad_tma(self, h2, weight, g, bias, labels, lse, p_scale, scale, v0, spec):
        """:func:`~.kernels.grad_tma_kernel`: the input-dtype gradient ``g [N, c]`` (any row
        stride, not overlapping the operands) of the vocabulary columns ``[v0, v0 + c)``
        straight from ``h2 [N, H]`` and ``weight`` (16-bit, 16-byte aligned rows, on a
        :func:`tma_device`), as :meth:`logits_grad_cols` forms it from float32 logits;
        ``labels`` int64 (< 0: row not counted), ``lse``, ``p_scale``, ``scale`` float32
        ``[N]``."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        n, c = g.shape
        if n == 0 or c == 0:
            return
        dev = h2.device
        cuda = dev.type == "cuda"
        bm, bn, bk, stages, warps = TMA_GRAD_TILES if cuda else (16, 32, 16, 1, 4)
        tiles = triton_cdiv(n, bm) * triton_cdiv(c, bn)
        programs = min(tiles, num_sms(dev) if cuda else 3)
        grad_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(h2, [bm, bk]),
            TensorDescriptor.from_tensor(weight, [bn, bk]),
            g, g.stride(0), bias if bias is not None else h2, labels, lse, p_scale, scale,
            n, c, v0, weight.shape[0], h2.shape[1], float(spec.softcap or 1.0),
            float(spec.label_smoothing), programs,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=spec.softcap is not None,
            SMOOTHING=spec.label_smoothing != 0.0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=8, WARP_SPECIALIZE=TMA_WARP_SPECIALIZE and cuda,
            FAST_MATH=ZERO_FAST_MATH and nvidia_ptx(dev), UPCAST=not cuda, FIX_RNE=not cuda,
            num_stages=stages, num_warps=warps,
        )  # fmt: skip


#: Whether the zero-logits path's epilogue kernels (:func:`~.kernels.lse_cols_kernel`,
#: :func:`~.kernels.logits_grad_cols_kernel`, :func:`~.kernels.lse_tma_kernel`,
#: :func:`~.kernels.grad_tma_kernel`) take the PTX
#: ``exp``/``tanh`` approximations (``FAST_MATH``, kernels module docstring) on NVIDIA GPUs,
#: as the row kernel does (probes switch it off for A/B runs).
ZERO_FAST_MATH = True
#: ``(BLOCK_R, BLOCK_C, num_warps)`` of :func:`~.kernels.logits_grad_cols_kernel` on a GPU:
#: the fastest of 7 settings on an H200 (this one and :data:`LSE_COLS_LAUNCH`, of 9: summed
#: over four shapes; BENCHMARKS.md, 2026-12-02 night).
GRAD_COLS_LAUNCH = (2, 1024, 4)
#: ``(BLOCK_R, BLOCK_C, num_warps)`` of :func:`~.kernels.lse_cols_kernel` on a GPU.
LSE_COLS_LAUNCH = (4, 512, 4)


#: :func:`~.kernels.lse_tma_kernel` on a GPU: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_stages,
#: num_warps)``, and whether its tile loop is warp-specialised: the best or within 1 % of the
#: best of five settings at Llama-3, Gemma-2 and Gemma-3 shapes on an H200 (BENCHMARKS.md,
#: 2026-12-02 night). Four stages of 128 x 64 and 256 x 64 16-bit tiles take 192 KiB of
#: shared memory: :data:`TMA_MIN_SHARED_MEM`.
TMA_FORWARD_TILES = (128, 256, 64, 4, 8)
TMA_WARP_SPECIALIZE = True
#: Beyond this many rows per hidden unit (``N / H``), :meth:`CudaLaunchers.lse_tma` runs
#: :func:`~.kernels.lse_tma_runs_kernel` (the whole vocabulary in one launch, a partial per
#: run of column blocks) instead of :func:`~.kernels.lse_tma_kernel` (a partial per column
#: block, so many rows leave few blocks a slice: 128 slices at 32K rows). On an H200, forward
#: alone: Gemma-3-270M at 32K rows (N/H = 51) 22.5 ms against 26.4 (and the Triton forward's
#: 25.1); at N/H <= 8 within 3 % either way except Gemma-2 (N/H = 3.6, softcap), 14 % slower
#: (BENCHMARKS.md, 2026-12-03).
TMA_RUNS_MIN_ROWS_PER_HIDDEN = 16
#: :func:`~.kernels.grad_tma_kernel` on a GPU, as :data:`TMA_FORWARD_TILES`: at Gemma-2's
#: shape on an H200 65.5 ms fwd+bwd against 82.4 with 128 x 256 tiles (its larger epilogue),
#: the others of five settings within 1 ms (BENCHMARKS.md, 2026-12-03).
TMA_GRAD_TILES = (128, 128, 64, 4, 8)
TMA_MIN_SHARED_MEM = 200 * 1024
#: Oldest Triton the GPU runs :func:`~.kernels.lse_tma_kernel` with (the one measured).
TMA_MIN_TRITON = (3, 6)
#: Partial bytes per row and :func:`~.kernels.lse_tma_kernel` column block (4 float32).
TMA_PART_ROW_BLOCK_BYTES = 16
#: Most bytes of the zero-logits TMA forward's partials: :func:`~.kernels.lse_tma_kernel`'s run
#: the vocabulary in slices of as many column blocks, each merged into the rows' state after its
#: launch; :func:`~.kernels.lse_tma_runs_kernel`'s cut it into as many runs (beyond 262144
#: rows, either in groups of rows).
TMA_PART_BYTES = 4 * 2**20


def _triton_has_tma_loops() -> bool:
    """Whether this Triton has what :func:`~.kernels.lse_tma_kernel` uses: host tensor
    descriptors and ``tl.range(..., flatten=, warp_specialize=)``."""
    import inspect

    import triton.language as tl

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    params = inspect.signature(tl.range.__init__).parameters
    return "flatten" in params and "warp_specialize" in params


@functools.lru_cache(maxsize=None)
def tma_device(device: torch.device) -> bool:
    """Whether :meth:`CudaLaunchers.lse_tma` can run on ``device``: a Hopper GPU (compute
    capability 9.x, where it was measured; Triton's warp specialisation is young, and other
    architectures keep the kernels measured there) with the shared memory of
    :data:`TMA_FORWARD_TILES` and Triton >= :data:`TMA_MIN_TRITON` (the version measured); or
    the CPU (the Triton interpreter, which tests it) with any Triton that has the API."""
    if not _triton_has_tma_loops():
        return False
    if device.type == "cpu":
        return True
    import triton

    try:
        version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2])
    except ValueError:  # an unparsable development version: not the one measured
        return False
    return (nvidia_ptx(device) and version >= TMA_MIN_TRITON
            and torch.cuda.get_device_capability(device)[0] == 9
            and max_shared_mem(device) >= TMA_MIN_SHARED_MEM)  # fmt: skip


def tma_operands(*tensors) -> bool:
    """Whether each tensor can be a TMA descriptor's ``[rows, cols]`` matrix: unit column
    stride, 16-byte aligned start and rows, rows that do not overlap (no stride-0 view), and
    at most :data:`TMA_MAX_EXTENT_BYTES` bytes from its first element to the end of its last."""
    for t in tensors:
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
        if t.stride(0) < t.shape[1]:
            return False
        rows, cols = t.shape
        if ((rows - 1) * t.stride(0) + cols) * t.element_size() > TMA_MAX_EXTENT_BYTES:
            return False
    return True


#: Most bytes a TMA operand may span. Triton 3.9.0's ``fill_tma_descriptor`` (not 3.6.0's)
#: sums a descriptor's byte extent in a 32-bit ``int`` for its workaround of a Blackwell
#: driver bug (CUDA drivers <= 13.1 clear bit 85 of descriptors of allocations under 128 KiB;
#: triton-lang/triton#9235): from 2 GiB on the sum wraps and can clear that bit of a Hopper
#: descriptor, whose layout that workaround does not describe. Such operands (e.g. a
#: 152064 x 8192 bfloat16 lm_head) take the paths without TMA.
TMA_MAX_EXTENT_BYTES = 2**31 - 1


#: The default launchers of both drivers.
CUDA_LAUNCHERS = CudaLaunchers()


@dataclass(frozen=True)
class TunedRowLaunchers(CudaLaunchers):
    """:class:`CudaLaunchers` with the row kernel launched as a
    :class:`~.chunked_path.ChunkedTuning` says (issue 14 measurements; not a default):
    ``block_v`` / ``warps`` / ``stages`` overrides, and with ``programs > 0`` a persistent grid
    of ``programs`` x SM-count programs looping over rows (at most one per row). The kernel
    computes each row the same way in both grids."""

    tuning: Any

    def _row_launch(self, vocab, device):
        cfg = self.tuning.row_config(row_kernel_config(vocab, device), vocab)
        programs = 0
        if self.tuning.programs > 0:
            programs = max(1, round(self.tuning.programs * num_sms(device)))
        return cfg, programs

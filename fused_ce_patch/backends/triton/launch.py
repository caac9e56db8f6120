"""Launch configuration and small host-side helpers shared by the two Triton drivers.

Block sizes are chosen per device: a CUDA GPU gets sizes checked on an H200 (BENCHMARKS.md,
"## GPU"); CPU tensors, which only the Triton interpreter (``TRITON_INTERPRET=1``, used by CI)
runs, get small legal sizes and no software pipelining, since it runs every program in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import (
    dhidden_rows_store_kernel,
    logits_grad_inplace_kernel,
    target_dweight_kernel,
)


@dataclass(frozen=True)
class RowKernelConfig:
    """Launch of :func:`logits_grad_inplace_kernel` (one program per row)."""

    block_v: int
    num_warps: int
    num_stages: int = 3


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
    return RowKernelConfig(block_v=min(4096, _pow2(vocab)), num_warps=8, num_stages=3)


def forward_tile_config(dtype: torch.dtype, device: torch.device) -> TileConfig:
    if device.type != "cuda":
        return TileConfig(16, 32, 32, 32, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return TileConfig(64, 64, 32, 64, num_warps=4, num_stages=3)
    return TileConfig(128, 128, 64, 64, num_warps=8, num_stages=3)


def backward_tile_config(dtype: torch.dtype, device: torch.device) -> TileConfig:
    if device.type != "cuda":
        return TileConfig(16, 32, 32, 32, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return TileConfig(64, 64, 32, 64, num_warps=4, num_stages=2)
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


def launch_logits_grad(z, labels, lse, nll, loss, coef, scale, spec, *, compute_lse,
                       write_grad):
    """Run :func:`logits_grad_inplace_kernel` over the ``[r, V]`` chunk ``z``.

    ``lse`` and ``nll`` (``LSE - z_y``, kept unrounded by LSE for the target column's
    gradient) are written when ``compute_lse``, read otherwise.
    """
    r, vocab = z.shape
    if r == 0:
        return
    cfg = row_kernel_config(vocab, z.device)
    mode, scale_t, scale_v = scale_args(scale if write_grad else 1.0, z.device)
    dummy = lse
    logits_grad_inplace_kernel[(r,)](
        z,
        z.stride(0),
        labels,
        lse,
        nll,
        loss if loss is not None else dummy,
        coef if coef is not None else dummy,
        scale_t,
        scale_v,
        vocab,
        float(spec.softcap or 1.0),
        float(spec.label_smoothing),
        float(spec.z_loss),
        HAS_SOFTCAP=spec.softcap is not None,
        SMOOTHING=spec.label_smoothing != 0.0,
        Z_LOSS=spec.z_loss != 0.0,
        SCALE_MODE=mode,
        COMPUTE_LSE=compute_lse,
        WRITE_GRAD=write_grad,
        BLOCK_V=cfg.block_v,
        FIX_RNE=z.device.type == "cpu",
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
    )


def launch_dhidden_rows(dh, out_rows, *, part=None, coef=None, labels=None, weight=None,
                        accumulate=False):
    """``dH[out_rows] (+)= part + coef * W[labels]`` (:func:`dhidden_rows_store_kernel`)."""
    r = out_rows.shape[0]
    hsize = dh.shape[1]
    if r == 0:
        return
    block_h = min(1024 if dh.device.type == "cuda" else 256, _pow2(hsize))
    dummy = out_rows
    w = weight if weight is not None else dh
    dhidden_rows_store_kernel[(r, triton_cdiv(hsize, block_h))](
        dh,
        dh.stride(0),
        part if part is not None else dh,
        part.stride(0) if part is not None else 0,
        out_rows,
        coef if coef is not None else dummy,
        labels if labels is not None else dummy,
        w,
        w.stride(0),
        w.stride(1),
        hsize,
        HAS_PART=part is not None,
        ADD_TARGET=coef is not None,
        ACCUMULATE=accumulate,
        BLOCK_H=block_h,
        FIX_RNE=dh.device.type == "cpu",
        num_warps=4,
    )


def launch_target_dweight(dw, db, labels, coef, hidden, row_off, *, v_lo=0, v_hi=None,
                          sorted_labels=None):
    """Add the target column's share of dW and db (float32 ``[V]``) for counted rows whose
    label is in ``[v_lo, v_hi)`` (:func:`target_dweight_kernel`); ``dw`` holds the rows
    ``[v_lo, v_hi)``. ``labels``, ``coef`` and ``row_off`` are ``[M]``; ``sorted_labels`` is
    ``torch.sort(labels, stable=True)`` if already known."""
    m = labels.shape[0]
    if m == 0 or (dw is None and db is None):
        return
    if sorted_labels is None:
        sorted_labels = torch.sort(labels, stable=True)
    sorted_labels, order = sorted_labels
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


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)

"""Backend ``"triton"``: fused linear cross-entropy on CUDA (and ROCm) GPUs.

Two algorithms, chosen by ``logits_budget``:

- budget > 0 (default :func:`default_budget`, the speed policy): the chunked path
  (:mod:`.chunked_path`): per chunk of counted rows, logits by one cuBLAS matmul in the input
  dtype, one Triton kernel that writes the logits gradient over them, dH and dW by matmuls.
- budget 0: the zero-logits path (:mod:`.zero_logits`): logit tiles live in registers only;
  forward keeps one float32 LSE per counted row, backward recomputes the tiles.

A positive budget too small for 16 whole rows of logits (or for all rows, if fewer) runs the
zero-logits path, which needs only a few MiB (:func:`run_paths`). The drivers call their
kernels through a launcher object (:class:`~.launch.Launchers`), so backend ``"ascend"`` runs
the same drivers with its own kernels. float64 inputs run the ``torch`` backend's
chunked algorithm (Triton's float64 matmuls would gain nothing over it).

Precision: 16-bit inputs multiply on tensor cores with float32 accumulation; float32 inputs
use IEEE float32 unless torch allows TF32 for matmuls
(``torch.backends.cuda.matmul.allow_tf32`` or ``torch.set_float32_matmul_precision``), which
cuBLAS and the Triton kernels then both use.

The kernels also run on CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests them); Triton
is imported only when the backend runs, so machines without it still import the package.
"""

from __future__ import annotations

import functools
import os

import torch

from ..base import Backend, Problem
from ..registry import register

#: The memory-first chunk size (``logits_budget=MEMORY_FIRST_BUDGET``; the default until
#: 2026-12-04): transient bytes per 8192 counted rows, between it and twice it, counting each
#: chunk's logits and also its copy of the hidden rows and its ``dz @ W`` rows. The peak beyond
#: dH and dW stays under 256 MiB up to 8192 counted rows and under 512 MiB beyond. An explicit
#: ``logits_budget`` counts the logits only.
MEMORY_FIRST_BUDGET = 248 * 2**20
DEFAULT_BUDGET = MEMORY_FIRST_BUDGET  # the name benchmarks and older callers use
#: The speed policy's ceiling on a chunk's transient bytes (:func:`default_budget`): 1 GiB less
#: room for the per-row float32 state and the allocator's rounding, so the whole call stays
#: within 1 GiB beyond its inputs and gradients.
SPEED_CAP = 2**30 - 32 * 2**20
#: ... and at most this fraction of the device's memory (a 24 GiB card: 384 MiB).
DEVICE_SHARE = 1 / 64
#: Fewest whole rows a chunk should hold; smaller budgets run the zero-logits path.
MIN_CHUNK_ROWS = 16

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def memory_first_budget(n_valid: int) -> int:
    """:data:`MEMORY_FIRST_BUDGET` per 8192 counted rows, at least it and at most twice it."""
    per_row = MEMORY_FIRST_BUDGET / 8192
    return int(min(2 * MEMORY_FIRST_BUDGET, max(MEMORY_FIRST_BUDGET, per_row * n_valid)))


def chunk_row_bytes(vocab: int, hidden_size: int, itemsize: int) -> int:
    """Transient bytes one counted row costs the default chunk: its logits, its copy of the
    hidden row, and its float32 ``dz @ W`` row."""
    return vocab * itemsize + hidden_size * (itemsize + 4)


def default_budget(n_valid: int, vocab: int, hidden_size: int, itemsize: int,
                   device: torch.device | None = None) -> int:
    """Default chunk size of the chunked path, in transient bytes (:func:`chunk_row_bytes` a
    counted row): the speed policy.

    Larger chunks run the three matmuls faster (dW sums over a chunk's rows: a short inner
    dimension is what slows the 256 MiB chunks, BENCHMARKS.md "Default budget policy"), so the
    policy takes the largest chunk that keeps two promises:

    - at most ``min(SPEED_CAP, DEVICE_SHARE * device memory)``: 992 MiB on an 80 GiB or larger
      GPU, less on smaller ones;
    - at most half the counted rows (rounded up) at once, so the call holds at most about half
      of what a method that materialises the counted rows' logits holds (Cut Cross-Entropy's ``torch_compile``
      implementation, the fastest exact peer measured, holds about all of them);

    and never less than :func:`memory_first_budget` (the budget before this policy), so no
    call's chunks get smaller than they were.

    Args:
        n_valid: counted rows (labels other than ``ignore_index``).
        vocab: ``V``, rows of the lm_head weight.
        hidden_size: ``H``.
        itemsize: bytes per element of the inputs (2 for bf16/fp16, 4 for float32).
        device: where the call runs; a CUDA device's total memory scales the cap.

    Returns:
        Transient bytes one chunk may hold, extras included (> 0).
    """
    cap = SPEED_CAP
    if device is not None and device.type == "cuda":
        cap = min(cap, int(_device_memory(device.index) * DEVICE_SHARE))
    half = -(-n_valid // 2) * chunk_row_bytes(vocab, hidden_size, itemsize)  # two chunks
    return max(memory_first_budget(n_valid), min(cap, half))


@functools.lru_cache(maxsize=None)
def _device_memory(index: int | None) -> int:
    return torch.cuda.get_device_properties(
        torch.cuda.current_device() if index is None else index).total_memory


class TritonBackend(Backend):
    """Tiled Triton kernels for CUDA/ROCm tensors (CPU tensors only under the interpreter)."""

    name = "triton"
    priority = 100
    device_types = ("cuda",)

    def availability(self) -> tuple[bool, str]:
        try:
            import triton  # noqa: F401
        except Exception as exc:  # ImportError, or a broken install
            return False, (f"triton is not importable ({type(exc).__name__}: {exc}); CUDA builds "
                           "of torch bring it, else pip install 'fused_ce_patch[triton]'")
        return True, ""

    def accepts(self, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        if dtype not in _DTYPES:
            return False, f"dtype {dtype} is not float16, bfloat16, float32 or float64"
        if device.type == "cuda":
            return True, ""
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
            return True, ""
        return False, (
            f"Triton kernels run on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), "
            f"not on {device.type}"
        )

    def run(self, problem: Problem) -> torch.Tensor:
        if problem.hidden.dtype == torch.float64:
            from ..torch_chunked import TorchBackend

            return TorchBackend().run(problem)
        budget = problem.logits_budget
        itemsize = problem.hidden.element_size()
        per_row = problem.vocab_size * itemsize
        if budget is None:
            budget = default_budget(problem.n_valid, problem.vocab_size, problem.hidden_size,
                                    itemsize, problem.hidden.device)
            per_row = chunk_row_bytes(problem.vocab_size, problem.hidden_size, itemsize)
        from .chunked_path import tuning_from_env

        return run_paths(problem, budget // per_row, tuning=tuning_from_env())


def run_paths(problem: Problem, rows_max: int, launchers=None, tuning=None) -> torch.Tensor:
    """Run a 16/32-bit ``problem`` on the chunked path, at most ``rows_max`` counted rows a
    chunk in chunks of (nearly) equal size, or on the zero-logits path when fewer than
    :data:`MIN_CHUNK_ROWS` whole rows fit (or all rows, if fewer; ``rows_max`` is 0 for
    ``logits_budget=0``). The drivers launch their kernels through ``launchers``
    (:class:`~.launch.Launchers`; None: the CUDA kernels). Shared with backend ``"ascend"``.
    ``tuning``: schedule variants of the chunked path
    (:class:`~.chunked_path.ChunkedTuning`, None: the default schedule); they scale the rows
    per chunk after the path is chosen, and row-kernel settings need the CUDA launchers.
    """
    hidden, weight, bias = problem.hidden, problem.weight, problem.bias
    grad_on = torch.is_grad_enabled()
    need = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    if launchers is None:
        from .launch import CUDA_LAUNCHERS as launchers
    if rows_max >= min(MIN_CHUNK_ROWS, max(problem.n_valid, 1)):
        from ..chunked import forward_grad_safe
        from .chunked_path import (
            ChunkedConfig,
            ChunkedTuning,
            TritonChunkedLinearCrossEntropy,
            plan_rows,
        )

        if tuning is None:
            tuning = ChunkedTuning()
        if tuning.tunes_row_kernel:
            from .launch import CudaLaunchers, TunedRowLaunchers

            if type(launchers) is not CudaLaunchers:
                raise ValueError("row-kernel tuning applies to the CUDA launchers only")
            launchers = TunedRowLaunchers(tuning)
        if tuning.rows_factor != 1.0:
            rows_max = max(1, int(rows_max * tuning.rows_factor))
        cfg = ChunkedConfig(
            spec=problem.spec,
            reduction=problem.reduction,
            scale=problem.scale,
            n_valid=problem.n_valid,
            rows=plan_rows(problem.n_valid, rows_max),
            # float16 recomputes: see fused_ce_patch.backends.chunked.forward_grad_safe
            eager=problem.reduction == "sum" and any(need) and forward_grad_safe(hidden.dtype),
            need=need,
            launchers=launchers,
            tuning=tuning,
        )
        return TritonChunkedLinearCrossEntropy.apply(
            hidden, weight, bias, problem.labels, problem.valid_rows, cfg
        )

    from .zero_logits import TritonZeroLogitsLinearCrossEntropy, ZeroLogitsConfig

    if bias is not None:
        bias = bias.contiguous()  # its kernels index bias by column, unit stride ([V] is cheap)
    cfg = ZeroLogitsConfig(
        spec=problem.spec,
        reduction=problem.reduction,
        scale=problem.scale,
        n_valid=problem.n_valid,
        launchers=launchers,
        need_hidden_grad=need[0],
    )
    return TritonZeroLogitsLinearCrossEntropy.apply(
        hidden, weight, bias, problem.labels, problem.valid_rows, cfg
    )


register(TritonBackend())

"""Backend ``"ascend"``: fused linear cross-entropy on Huawei Ascend NPUs through triton-ascend.

The two algorithms of backend ``"triton"``, chosen by ``logits_budget`` the same way:

- budget > 0 (default :data:`DEFAULT_BUDGET`): the chunked path (:mod:`.chunked_path`): per
  chunk of counted rows, logits by one matmul in the input dtype, one Triton kernel that
  writes the logits gradient over them, dH and dW by matmuls.
- budget 0, or too small for 16 whole rows: the zero-logits path (:mod:`.zero_logits`): logit
  tiles live on chip only; forward keeps one float32 LSE per counted row, backward recomputes.

What is NPU-specific is the launch (:mod:`.config`): block sizes derived from the chip's
Unified Buffer, persistent grids of one program per AI / vector core, and kernels restricted
to what triton-ascend supports (:mod:`.kernels`). float64 inputs run the ``torch`` backend's
chunked algorithm.

Availability: ``torch_npu`` and triton-ascend must import; neither is imported until a call
needs them (``import fused_ce_patch`` stays light). ``"auto"`` picks this backend for ``npu``
tensors only. CPU tensors are accepted when ``TRITON_INTERPRET=1`` and the backend is asked for
by name — how CI runs these kernels in the Triton interpreter. Nothing here has run on Ascend
hardware (docs/ascend.md).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..base import Backend, Problem
from ..registry import register

#: Default transient-logits budget of the chunked path (bytes), as backend ``"triton"``.
DEFAULT_BUDGET = 224 * 2**20
#: Fewest whole rows a chunk should hold; smaller budgets run the zero-logits path.
MIN_CHUNK_ROWS = 16

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _is_triton_ascend() -> tuple[bool, str]:
    """Whether the importable ``triton`` is triton-ascend (it carries an ``npu`` backend)."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton-ascend is not installed (no module 'triton')"
    try:
        import triton.backends as tb

        names = set(getattr(tb, "backends", {}) or {})
    except Exception as exc:  # a broken install
        return False, f"triton does not import ({type(exc).__name__}: {exc})"
    if "ascend" in names or "npu" in names:
        return True, ""
    try:  # how flash-linear-attention asks: the active driver's target
        import triton

        if triton.runtime.driver.active.get_current_target().backend == "npu":
            return True, ""
    except Exception:
        pass
    return False, (
        f"the installed triton has backends {sorted(names)}, not triton-ascend's 'ascend' "
        f"(pip uninstall triton && pip install triton-ascend)"
    )


class AscendBackend(Backend):
    """Triton kernels for Ascend NPU tensors (CPU tensors only under the interpreter)."""

    name = "ascend"
    priority = 50
    device_types = ("npu",)

    @property
    def auto(self) -> bool:
        """Whether ``"auto"`` may pick this backend: not under the interpreter, where it is
        for explicit ``backend="ascend"`` calls (CI) only and CPU tensors belong elsewhere."""
        return not _interpreting()

    def availability(self) -> tuple[bool, str]:
        if _interpreting():
            if importlib.util.find_spec("triton") is None:
                return False, "triton is not installed"
            return True, ""
        if importlib.util.find_spec("torch_npu") is None:
            return False, "torch_npu is not installed"
        try:
            import torch_npu  # noqa: F401  registers the 'npu' device with torch
        except Exception as exc:
            return False, f"torch_npu does not import ({type(exc).__name__}: {exc})"
        return _is_triton_ascend()

    def accepts(self, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        if dtype not in _DTYPES:
            return False, f"dtype {dtype} is not float16, bfloat16, float32 or float64"
        if device.type == "npu":
            return True, ""
        if device.type == "cpu" and _interpreting():
            return True, ""
        return False, (
            f"triton-ascend kernels run on NPU tensors (or CPU tensors under "
            f"TRITON_INTERPRET=1), not on {device.type}"
        )

    def run(self, problem: Problem) -> torch.Tensor:
        hidden, weight, bias = problem.hidden, problem.weight, problem.bias
        if hidden.dtype == torch.float64:
            from ..torch_chunked import TorchBackend

            return TorchBackend().run(problem)

        from .chip import detect_chip
        from .config import launch_config

        chip = detect_chip(hidden.device)
        launch = launch_config(problem.n_valid, problem.hidden_size, problem.vocab_size,
                               hidden.dtype, chip)  # fmt: skip
        grad_on = torch.is_grad_enabled()
        need = (
            grad_on and hidden.requires_grad,
            grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad,
        )
        budget = DEFAULT_BUDGET if problem.logits_budget is None else problem.logits_budget
        rows = budget // (problem.vocab_size * hidden.element_size())
        if budget > 0 and rows >= min(MIN_CHUNK_ROWS, max(problem.n_valid, 1)):
            from .chunked_path import AscendChunkedLinearCrossEntropy, ChunkedConfig

            cfg = ChunkedConfig(
                spec=problem.spec,
                reduction=problem.reduction,
                scale=problem.scale,
                n_valid=problem.n_valid,
                rows=max(1, min(rows, problem.n_valid)),
                eager=problem.reduction == "sum" and any(need),
                need=need,
                launch=launch,
            )
            return AscendChunkedLinearCrossEntropy.apply(
                hidden, weight, bias, problem.labels, problem.valid_rows, cfg
            )

        from .zero_logits import AscendZeroLogitsLinearCrossEntropy, ZeroLogitsConfig

        cfg = ZeroLogitsConfig(
            spec=problem.spec,
            reduction=problem.reduction,
            scale=problem.scale,
            n_valid=problem.n_valid,
            launch=launch,
        )
        return AscendZeroLogitsLinearCrossEntropy.apply(
            hidden, weight, bias, problem.labels, problem.valid_rows, cfg
        )


register(AscendBackend())

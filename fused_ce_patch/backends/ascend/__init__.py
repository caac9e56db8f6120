"""Backend ``"ascend"``: fused linear cross-entropy on Huawei Ascend NPUs through triton-ascend.

The two algorithms of backend ``"triton"``, run by its drivers and chosen by ``logits_budget``
the same way (:func:`~fused_ce_patch.backends.triton.run_paths`):

- budget > 0 (default :data:`DEFAULT_BUDGET`): the chunked path
  (``triton/chunked_path.py``): per chunk of counted rows, logits by one matmul in the input
  dtype, one Triton kernel that writes the logits gradient over them, dH and dW by matmuls.
- budget 0, or too small for 16 whole rows: the zero-logits path (``triton/zero_logits.py``):
  logit tiles live on chip only; forward keeps one float32 LSE per counted row, backward
  recomputes.

What is NPU-specific is the launch: the drivers call the ``triton`` backend's kernels
(``triton/kernels.py``, restricted to what triton-ascend supports, with compile-time switches
for the NPU) through :class:`~.launch.AscendLaunchers`, with block sizes derived from the
chip's Unified Buffer and persistent grids of one program per AI / vector core (:mod:`.config`). float64 inputs run the ``torch`` backend's chunked algorithm.

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

#: Default transient-logits budget of the chunked path (bytes); fewer than
#: :data:`~fused_ce_patch.backends.triton.MIN_CHUNK_ROWS` whole rows run the zero-logits path.
DEFAULT_BUDGET = 224 * 2**20

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
        if problem.hidden.dtype == torch.float64:
            from ..torch_chunked import TorchBackend

            return TorchBackend().run(problem)

        from ..triton import run_paths
        from .chip import detect_chip
        from .config import launch_config
        from .launch import AscendLaunchers

        hidden = problem.hidden
        launch = launch_config(problem.n_valid, problem.hidden_size, problem.vocab_size,
                               hidden.dtype, detect_chip(hidden.device))  # fmt: skip
        budget = DEFAULT_BUDGET if problem.logits_budget is None else problem.logits_budget
        rows = budget // (problem.vocab_size * hidden.element_size())
        return run_paths(problem, rows, AscendLaunchers(launch))


register(AscendBackend())

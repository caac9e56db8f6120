"""Import the Triton kernels for the interpreter (CPU tensors, ``TRITON_INTERPRET=1``).

A ``@triton.jit`` function becomes an interpreted one when its module is imported while the
variable is set: :func:`import_kernels` imports every kernel module once that way, then leaves
the variable as it was for the rest of the session (the tests set it per test).
"""

from __future__ import annotations

import importlib
import os

MODULES = (
    "fused_ce_patch.backends.triton.kernels",
    "fused_ce_patch.backends.triton.launch",
    "fused_ce_patch.backends.triton.chunked_path",
    "fused_ce_patch.backends.triton.zero_logits",
    "fused_ce_patch.backends.triton.stats_kernels",
    "fused_ce_patch.backends.triton.token_stats",
    "fused_ce_patch.backends.triton.distill_kernels",
    "fused_ce_patch.backends.ascend.launch",
)


def import_kernels() -> None:
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in MODULES:
            importlib.import_module(name)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved

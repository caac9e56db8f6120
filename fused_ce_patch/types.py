"""Type names of the public API (for annotations and type checkers; nothing here runs)."""

from __future__ import annotations

from typing import Literal

#: The ``backend=`` values the package ships. A backend registered at run time through
#: :func:`fused_ce_patch.backends.registry.register` is accepted too; type checkers will
#: flag its name, the call will not.
BackendName = Literal["auto", "triton", "ascend", "torch", "reference"]

#: The ``reduction=`` values of :func:`fused_ce_patch.fused_linear_cross_entropy`.
Reduction = Literal["mean", "sum", "none"]

__all__ = ["BackendName", "Reduction"]

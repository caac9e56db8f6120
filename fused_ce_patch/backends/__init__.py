"""Backends and the registry that chooses among them (docs/design.md §4).

Priority under ``"auto"``: ``triton`` (CUDA/ROCm), ``ascend`` (NPU), ``torch`` (anything);
``reference`` only when asked for.
"""

from .base import Backend, LossSpec, Problem
from .reference import ReferenceBackend
from .registry import backend_names, explain, get_backend, register, resolve
from .torch_chunked import TorchBackend

register(ReferenceBackend())
register(TorchBackend())
from . import triton as _triton  # noqa: E402,F401  registers backend "triton" (imports no triton)
from . import ascend as _ascend  # noqa: E402,F401  registers "ascend" (imports no torch_npu)

__all__ = [
    "Backend",
    "LossSpec",
    "Problem",
    "backend_names",
    "explain",
    "get_backend",
    "register",
    "resolve",
]

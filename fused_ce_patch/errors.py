"""Exceptions raised by fused_ce_patch, importable without torch-heavy modules."""

from __future__ import annotations


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run this call (missing package, wrong device)."""


class UnsupportedModelError(ValueError):
    """``apply_fused_ce`` was given a model whose architecture has no patch."""


class LogitsNotMaterializedError(RuntimeError):
    """Something used ``outputs.logits`` after the fused loss path, which never builds them."""

"""Backend registry: each backend registers a name, an availability check and a check of the
call (device, dtype); ``"auto"`` walks the registry by priority.

Adding a backend touches its own module and one :func:`register` line in ``backends/__init__``.
"""

from __future__ import annotations

import os
import warnings

import torch

from ..errors import BackendUnavailableError
from .base import Backend

ENV_VAR = "FUSED_CE_BACKEND"

#: Names of docs/design.md §2 that are valid even before (or where) their module registers: asking
#: for one that is not registered raises BackendUnavailableError, not "unknown backend".
KNOWN_NAMES = ("triton", "ascend", "torch", "reference")

_REGISTRY: dict[str, Backend] = {}
_warned: set[tuple[str, str]] = set()


def register(backend: Backend) -> Backend:
    """Add ``backend`` under ``backend.name`` (replacing one of the same name)."""
    if not backend.name:
        raise ValueError("a backend needs a non-empty name")
    _REGISTRY[backend.name] = backend
    return backend


def backend_names() -> tuple[str, ...]:
    """Names accepted by ``backend=``: ``"auto"``, the names of docs/design.md §2, and every
    registered backend."""
    return ("auto", *KNOWN_NAMES, *(n for n in _REGISTRY if n not in KNOWN_NAMES))


def get_backend(name: str) -> Backend:
    """The registered backend called ``name``.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r}; valid backends: {', '.join(backend_names())}"
        ) from None


def explain(device: torch.device, dtype: torch.dtype) -> list[tuple[str, bool, str]]:
    """For each backend by priority: (name, would it run this device/dtype, why not)."""
    rows = []
    for backend in sorted(_REGISTRY.values(), key=lambda b: -b.priority):
        ok, why = backend.availability()
        if ok:
            ok, why = backend.accepts(device, dtype)
        rows.append((backend.name, ok, why))
    return rows


def resolve(name: str, device: torch.device, dtype: torch.dtype) -> Backend:
    """Choose the backend for a call on ``device`` with ``dtype``.

    ``"auto"`` honours ``$FUSED_CE_BACKEND`` first; otherwise it takes the highest-priority
    backend meant for ``device.type`` (its ``device_types``, or any type when empty) that is
    importable and accepts the call, and warns once when a backend meant for
    this device type (e.g. ``triton`` for CUDA) had to be passed over.

    Raises:
        ValueError: unknown backend name.
        BackendUnavailableError: an explicitly requested backend cannot run this call.
    """
    if name == "auto":
        env = os.environ.get(ENV_VAR, "").strip()
        if env and env != "auto":
            return _explicit(env, device, dtype, source=f"${ENV_VAR}={env}")
        return _auto(device, dtype)
    return _explicit(name, device, dtype, source=f"backend={name!r}")


def _explicit(name: str, device: torch.device, dtype: torch.dtype, source: str) -> Backend:
    if name in KNOWN_NAMES and name not in _REGISTRY:
        raise BackendUnavailableError(
            f"{source}: backend {name!r} is not available in this installation (registered: "
            f"{', '.join(_REGISTRY)}). Use backend='auto' to pick one that can run."
        )
    backend = get_backend(name)
    ok, why = backend.availability()
    if ok:
        ok, why = backend.accepts(device, dtype)
    if not ok:
        raise BackendUnavailableError(
            f"{source} cannot run on {device.type} tensors of dtype {dtype}: {why}. "
            f"Use backend='auto' to pick one that can."
        )
    return backend


def _auto(device: torch.device, dtype: torch.dtype) -> Backend:
    passed_over = []
    for backend in sorted(_REGISTRY.values(), key=lambda b: -b.priority):
        types = getattr(backend, "device_types", ())
        if types and device.type not in types:
            # A backend for another device type (e.g. triton on CPU tensors, which it accepts
            # under TRITON_INTERPRET=1 for tests) is for explicit requests only. Tested before
            # ``auto`` (the same skip), which may read the environment.
            continue
        if not backend.auto:
            continue
        ok, why = backend.availability()
        if ok:
            ok, why = backend.accepts(device, dtype)
        if ok:
            for skipped, reason in passed_over:
                key = (skipped, device.type)
                if key not in _warned:
                    _warned.add(key)
                    warnings.warn(
                        f"fused_ce_patch: backend {skipped!r} cannot run on this "
                        f"{device.type} device ({reason}); falling back to {backend.name!r}.",
                        RuntimeWarning,
                        stacklevel=4,
                    )
            return backend
        if device.type in getattr(backend, "device_types", ()):
            passed_over.append((backend.name, why))
    raise BackendUnavailableError(f"no backend can run {device.type} tensors of dtype {dtype}")

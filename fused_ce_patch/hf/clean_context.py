"""A context free of the caller's settings, for the proof's tiny models (:mod:`.proof`).

``apply_fused_ce`` may be called anywhere: inside ``torch.inference_mode()`` or ``no_grad``,
under CPU or CUDA autocast, with deterministic algorithms on, under a ``TorchFunctionMode`` or
``TorchDispatchMode`` (``torch.device(...)`` contexts and ``torch.set_default_device`` are
function modes too), at a lower float32 matmul precision. None of that is about the class
being proven, and each of it changes (or breaks) the numbers of a stock-against-patched
comparison, so :func:`clean_context` sets all of it aside while the proof runs and puts it back
afterwards, and it leaves the caller's random streams (torch CPU and CUDA, Python's
``random``, NumPy's global one when NumPy is loaded) and transformers' ``warning_once`` /
``info_once`` caches as they were: a message the proof's tiny model triggers is dropped, not
remembered, so the user's own model still prints it later.

:func:`caller_context` names what the caller had set (for the proof's cache: a refusal seen
under such a context is not remembered).
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys

import torch

__all__ = ["clean_context", "caller_context"]

#: Autocast device types set aside (each only where this torch build knows it).
_AUTOCAST_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "npu")


def _autocast_types(extra: str | None = None) -> list[str]:
    out = []
    for dt in (*_AUTOCAST_TYPES, extra):
        if dt and dt not in out:
            try:
                if torch.amp.is_autocast_available(dt):
                    out.append(dt)
            except (RuntimeError, TypeError, ValueError):
                pass
    return out


def caller_context() -> list[str]:
    """What of the caller's settings :func:`clean_context` sets aside (empty: nothing)."""
    out = []
    if torch.is_inference_mode_enabled():
        out.append("inference_mode")
    if not torch.is_grad_enabled():
        out.append("no_grad")
    out += [f"autocast({dt})" for dt in _autocast_types() if torch.is_autocast_enabled(dt)]
    if torch.are_deterministic_algorithms_enabled():
        out.append("deterministic algorithms")
    if torch._C._len_torch_function_stack():
        out.append("torch function modes")
    if torch._C._len_torch_dispatch_stack():
        out.append("torch dispatch modes")
    if torch.get_float32_matmul_precision() != "highest":
        out.append("float32 matmul precision")
    return out


@contextlib.contextmanager
def _no_function_modes():
    """The torch-function mode stack emptied (a ``torch.device`` context included)."""
    modes = []
    while torch._C._len_torch_function_stack():
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        while torch._C._len_torch_function_stack():  # anything the proof left pushed
            torch._C._pop_torch_function_stack()
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


@contextlib.contextmanager
def _no_dispatch_modes():
    if not torch._C._len_torch_dispatch_stack():
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


@contextlib.contextmanager
def _deterministic_off():
    on = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    precision = torch.get_float32_matmul_precision()
    try:
        torch.use_deterministic_algorithms(False)
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.use_deterministic_algorithms(on, warn_only=warn_only)


@contextlib.contextmanager
def _other_rngs():
    """Python's ``random`` and NumPy's global generator restored (torch's: ``fork_rng``)."""
    state = random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(state)
        if np_state is not None:
            numpy.random.set_state(np_state)


def _torch_rng(dev: torch.device):
    """torch's CPU generator forked, and every generator of ``dev``'s type already in use."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=[]))
    types = {"cuda"} | ({dev.type} if dev.type not in ("cpu", "meta") else set())
    for dt in sorted(types):
        mod = getattr(torch, dt, None)
        try:
            if mod is None or not mod.is_available() or not (
                    dt == dev.type or mod.is_initialized()):
                continue
            stack.enter_context(torch.random.fork_rng(devices=list(range(mod.device_count())),
                                                      device_type=dt))
        except (AttributeError, RuntimeError, TypeError):
            pass  # a device type without per-index RNG state: its generator is not forked
    return stack


#: ``logging.Logger`` attributes transformers adds, each an ``lru_cache`` over its arguments.
_ONCE = ("warning_once", "info_once")


@contextlib.contextmanager
def _once_caches_untouched(active):
    """transformers' ``logger.warning_once`` / ``info_once`` drop the message (do not call the
    cached function) while ``active()`` is true, so the proof leaves no entry in their caches.

    The replacement is on ``logging.Logger`` for the duration only and defers to the original
    in every other thread or context.
    """
    saved = {name: logging.Logger.__dict__.get(name) for name in _ONCE}
    wrappers = {}
    for name, original in saved.items():
        if original is None:
            continue

        def gated(self, *args, __original=original, **kwargs):
            if active():
                return None
            return __original(self, *args, **kwargs)

        gated.__wrapped__ = original
        wrappers[name] = gated
        setattr(logging.Logger, name, gated)
    try:
        yield
    finally:
        for name, gated in wrappers.items():
            if logging.Logger.__dict__.get(name) is gated:  # someone else's later swap is kept
                setattr(logging.Logger, name, saved[name])


@contextlib.contextmanager
def clean_context(dev: torch.device, active):
    """Run the proof on ``dev`` with none of the caller's settings (see the module docstring).

    Args:
        dev: the device the proof's tiny models run on (the default device inside).
        active: a callable, true while the proof runs in this context (transformers' "once"
            messages are dropped then).

    Inside: grad enabled, not in inference mode, autocast off on every device type, the
    function and dispatch mode stacks empty, deterministic algorithms off, float32 matmul
    precision "highest", float32 default dtype, ``dev`` the default device. Everything is as
    found afterwards, the random streams included.
    """
    dtype = torch.get_default_dtype()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_no_function_modes())
        stack.enter_context(_no_dispatch_modes())
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        for dt in _autocast_types(dev.type):
            stack.enter_context(torch.autocast(dt, enabled=False))
        stack.enter_context(_deterministic_off())
        stack.enter_context(_other_rngs())
        stack.enter_context(_torch_rng(dev))
        stack.enter_context(_once_caches_untouched(active))
        stack.callback(torch.set_default_dtype, dtype)
        torch.set_default_dtype(torch.float32)  # a tiny model as transformers builds it
        stack.enter_context(torch.device(dev))
        yield

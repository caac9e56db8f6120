"""Which functions are patched forwards, and the stock forward behind each.

Small tables shared by :mod:`.architectures` (which must not derive a spec from a forward
that already wraps a patched one), :mod:`.forward` (which fills the forward tables),
:mod:`.patch` (which fills the instance and class sets) and :mod:`.trl` (which routes TRL's
kernels while a patched instance exists), so that none of them imports another's internals.
"""

from __future__ import annotations

import weakref

#: Instances patched by ``apply_fused_ce`` (and their deep copies); classes patched by
#: ``apply_fused_ce_to_class``.
PATCHED_INSTANCES: weakref.WeakSet = weakref.WeakSet()
PATCHED_CLASSES: set = set()


class _Missing:
    """Marks "no entry in the instance __dict__"; survives copy/deepcopy/pickle as itself."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return "MISSING"

    def __repr__(self):
        return "<missing>"


MISSING = _Missing()

#: stock forward -> (patched forward, class slot)
PATCHED: dict = {}
#: patched forward -> stock forward
STOCK: dict = {}


def is_patched_forward(fn) -> bool:
    return fn in STOCK


def stock_forward_of(fn):
    """The stock forward behind a patched forward (``fn`` itself when not patched)."""
    return STOCK.get(fn, fn)


def wraps_patched(fn) -> bool:
    """True if ``fn`` is a patched forward or wraps one (``__wrapped__`` / ``__func__``)."""
    for _ in range(32):
        if fn is None:
            return False
        if fn in STOCK:
            return True
        fn = getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
    return False


def _is_amp_layer(fn) -> bool:
    """One layer of accelerate's native mixed-precision forward wrapper: the
    ``convert_outputs_to_fp32.<locals>.forward`` closure, the ``ConvertOutputsToFp32``
    object inside it, or torch's ``autocast`` decorator (``decorate_autocast``, which
    ``functools.wraps`` the forward, so it is told by its code object)."""
    if type(fn).__name__ == "ConvertOutputsToFp32" and \
            type(fn).__module__.startswith("accelerate."):
        return True
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    module = getattr(fn, "__module__", "") or ""
    if code.co_name == "forward" and module.startswith("accelerate.") and \
            getattr(fn, "__qualname__", "") == "convert_outputs_to_fp32.<locals>.forward":
        return True
    parts = code.co_filename.replace("\\", "/").split("/")
    return code.co_name == "decorate_autocast" and "torch" in parts and "amp" in parts


def inside_amp_wrapper(fn):
    """The forward inside accelerate's mixed-precision wrapper, or ``fn`` when it is none.

    ``Accelerator.prepare`` (native AMP: bf16/fp16) replaces ``model.forward`` with
    ``MethodType(convert_outputs_to_fp32(autocast(<forward found>.__func__)), model)``
    (accelerate 1.x ``prepare_model``): autocast around the call and float32 outputs, a
    wrapper that would wrap a stock forward in the same way. Each layer keeps its inner
    forward in ``__wrapped__``; the result is the (unbound) function found beneath.
    """
    inner = fn
    for _ in range(8):
        func = getattr(inner, "__func__", inner)
        if not _is_amp_layer(func):
            break
        inner = func.__wrapped__
    return inner

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

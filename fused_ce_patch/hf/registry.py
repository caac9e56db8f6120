"""Which functions are patched forwards, and the stock forward behind each.

One small table shared by :mod:`.architectures` (which must not derive a spec from a forward
that already wraps a patched one) and :mod:`.forward` (which fills it), so that neither imports
the other's internals.
"""

from __future__ import annotations

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

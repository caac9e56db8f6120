"""Put modules' globals and classes' ``forward`` back as they were (for tests that run a library,
such as Liger-Kernel, which patches transformers process-wide even when given ``model=``)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def kept(modules, classes):
    """Inside: anything may rebind, add or remove globals of ``modules`` and set ``forward``
    on ``classes``; on exit every one of them is as it was on entry."""
    saved = {m: dict(vars(m)) for m in modules}
    forwards = {c: c.__dict__["forward"] for c in classes}
    try:
        yield
    finally:
        for module, names in saved.items():
            for name in set(vars(module)) - set(names):
                delattr(module, name)
            for name, value in names.items():
                if vars(module).get(name) is not value:
                    setattr(module, name, value)
        for cls, fwd in forwards.items():
            cls.forward = fwd

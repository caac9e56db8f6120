"""Peak resident memory of this process, as the Linux kernel counts it.

The CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``, and tracemalloc
does not see torch's allocations. What the kernel does count is the resident set size (RSS,
pages of this process in RAM) and its high-water mark ``VmHWM`` in ``/proc/self/status``.
Writing ``5`` to ``/proc/self/clear_refs`` resets that mark to the current RSS (Linux >= 4.0),
so ``reset_peak(); work(); peak_rss()`` is the true peak of ``work`` — model, gradients,
optimizer state, activations and every transient such as the logits — without sampling.

The numbers are whole-process: they include the Python interpreter and libraries. Compare two
runs made the same way (each in its own fresh process) and the difference is what changed.
"""

from __future__ import annotations

import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int:
    """Resident set size of this process now, in bytes (0 where /proc is unavailable)."""
    kib = _status_kib("VmRSS")
    return (kib or 0) * 1024


def reset_peak() -> bool:
    """Reset the peak-RSS mark to the current RSS. Returns False where the kernel cannot."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_rss() -> int:
    """Peak resident set size since start or the last :func:`reset_peak`, in bytes.

    Falls back to ``getrusage`` (peak since process start) where ``VmHWM`` is unavailable.
    """
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024

"""The one timer behind every published benchmark number.

:func:`time_ms` runs a callable ``warmup`` times untimed, then ``iters`` times timed, and
returns the per-call times (milliseconds) in a :class:`Timing`; scripts report its median.

- CUDA: a start and an end ``torch.cuda.Event`` around each call, and a wait on the end
  event before the next call, so every call starts on an idle device and its time includes
  the host's launch work (what a training step pays). The device is synchronised once
  before the first timed call.
- elsewhere (CPU): ``time.perf_counter`` around each call (wall clock), plus
  ``time.process_time`` (CPU time of the whole process, all threads).

Why not ``triton.testing.do_bench``: its ``warmup`` / ``rep`` are durations in ms, so the
number of calls depends on their speed; the scripts here take counts (``--iters``,
``--warmup``, ``--steps``), and a full training step (optimizer state, compiled graphs)
must run a known number of times. ``do_bench`` also zeroes a 256 MB buffer before each
call to flush L2; ``flush_l2=True`` does the same (outside the timed window), off by
default because the heads timed here stream far more than the H200's L2 per call and
because the buffer would count in the peak-memory numbers some scripts take.

:class:`Laps` is the same clock split into named stages inside one call.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

L2_FLUSH_BYTES = 256 * 2**20  # as triton.testing.do_bench


@dataclass
class Timing:
    """Per-call times of :func:`time_ms`.

    Attributes:
        ms: wall time of each timed call, milliseconds (CUDA events on a GPU).
        cpu_ms: process CPU time of each call, milliseconds, summed over threads; ``None``
            on CUDA.
        peak_bytes: ``torch.cuda.max_memory_allocated`` over the timed calls (peak counter
            reset just before the first), bytes; ``None`` unless ``track_peak`` on CUDA.
    """

    ms: list[float]
    cpu_ms: list[float] | None = None
    peak_bytes: int | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    @property
    def min(self) -> float:
        return min(self.ms)

    @property
    def max(self) -> float:
        return max(self.ms)


def _is_cuda(device) -> bool:
    return str(device).split(":")[0] == "cuda"


def time_ms(fn: Callable[[], object], *, iters: int, warmup: int = 0, device="cpu",
            reset: Callable[[], None] | None = None, flush_l2: bool = False,
            track_peak: bool = False) -> Timing:
    """Time ``iters`` calls of ``fn`` after ``warmup`` untimed ones.

    Args:
        fn: the work, called with no arguments; its result is dropped.
        iters: timed calls, >= 1.
        warmup: untimed calls before them, >= 0.
        device: ``"cuda"`` / ``torch.device("cuda", i)`` for CUDA-event timing; anything
            else times with ``time.perf_counter``.
        reset: called after every call (warm-up and timed), outside the timed window,
            e.g. to set ``.grad`` to ``None``.
        flush_l2: on CUDA, zero a 256 MiB buffer before each timed call (outside the
            window), as ``triton.testing.do_bench`` does.
        track_peak: on CUDA, reset the peak-memory counter before the timed calls and
            report the peak over them in :attr:`Timing.peak_bytes`.

    Returns:
        Timing: per-call milliseconds.

    Raises:
        ValueError: ``iters`` < 1 or ``warmup`` < 0.
    """
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    for _ in range(warmup):
        fn()
        if reset is not None:
            reset()
    if not _is_cuda(device):
        wall, cpu = [], []
        for _ in range(iters):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
            if reset is not None:
                reset()
        return Timing(ms=wall, cpu_ms=cpu)

    import torch

    cache = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if flush_l2 else None
    torch.cuda.synchronize(device)
    if track_peak:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        if cache is not None:
            cache.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if reset is not None:
            reset()
    peak = torch.cuda.max_memory_allocated(device) if track_peak else None
    del cache
    return Timing(ms=times, peak_bytes=peak)


class Laps:
    """Named laps between consecutive marks inside one call: CUDA events on the GPU (no
    synchronisation until :meth:`totals`), ``time.perf_counter`` elsewhere. Laps with the
    same name add up."""

    def __init__(self, device):
        self.cuda = _is_cuda(device)
        self.marks = []

    def _now(self):
        if self.cuda:
            import torch

            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self):
        """Begin a lap without naming the time before it."""
        self.marks.append((None, self._now()))

    def lap(self, name: str):
        """End the current lap and charge it to ``name``."""
        self.marks.append((name, self._now()))

    def totals(self) -> dict[str, float]:
        """Milliseconds per lap name (synchronises the device on CUDA)."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            if name is None:
                continue
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            out[name] = out.get(name, 0.0) + ms
        return out

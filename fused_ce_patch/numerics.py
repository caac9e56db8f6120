"""The one error measure used across the project: tests, ``doctor`` and the benchmarks."""

from __future__ import annotations

import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` over the whole tensor, computed in float64.

    The Frobenius norm of the difference over that of the expected tensor, as a Python float;
    tensors may be on any device and of any floating (or integer) dtype, with or without
    ``requires_grad``. When ``expected`` is all zeros the absolute error ``||actual||`` is
    returned instead (0.0 when both are zero), never inf or NaN.

    Args:
        actual: the tensor under test.
        expected: the reference, same shape (broadcastable) as ``actual``.
    """
    a = actual.detach().to(device="cpu", dtype=torch.float64)
    b = expected.detach().to(device="cpu", dtype=torch.float64)
    diff = (a - b).norm().item()
    den = b.norm().item()
    return diff / den if den > 0 else diff


__all__ = ["relative_error"]

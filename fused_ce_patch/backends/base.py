"""The flat, already-validated problem every backend receives, and the backend interface.

``fused_ce_patch.loss`` checks and normalises a call once (shapes, dtypes, autocast, shift,
labels, reduction) and hands a :class:`Problem` to one backend. Backends never re-validate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossSpec:
    """The per-position loss, independent of how it is computed.

    Attributes:
        ignore_index: label value that marks a position that adds nothing.
        softcap: ``c`` in ``z = c * tanh(z / c)`` (Gemma-2 final-logit softcapping), or None.
        label_smoothing: ``eps`` in torch's definition, in ``[0, 1]``.
        z_loss: ``lambda`` of the PaLM z-loss ``lambda * LSE**2``, ``>= 0``.
    """

    ignore_index: int = -100
    softcap: float | None = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0


@dataclass
class Problem:
    """One validated call, flattened to rows.

    Attributes:
        hidden: ``[..., H]`` hidden states as given (possibly non-contiguous); rows are read
            through :func:`fused_ce_patch.backends.common.take_rows`, never copied whole.
        weight: ``[V, H]`` lm_head weight, same dtype and device as ``hidden``.
        bias: ``[V]`` or None.
        labels: ``[N]`` int64, flattened (and already shifted when ``shift=True``).
        valid_rows: ``[M]`` int64 indices of the counted rows (label != ignore_index), sorted.
        n_valid: ``M`` as a Python int (known on the host after validation).
        spec: the per-position loss.
        reduction: ``"none"`` (return ``[N]`` per-row losses, 0 at ignored rows) or ``"sum"``
            (return ``scale * sum`` as a 0-d tensor).
        scale: multiplier of the sum: a Python float or a 0-d float32 tensor on the device
            (``1 / num_items_in_batch`` may live on the device). Unused for ``"none"``.
        logits_budget: bytes of transient logits one chunk may hold; 0 asks for the
            zero-logits algorithm; None means the backend's default.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: torch.Tensor
    valid_rows: torch.Tensor
    n_valid: int
    spec: LossSpec
    reduction: str
    scale: float | torch.Tensor = 1.0
    logits_budget: int | None = None

    @property
    def n_rows(self) -> int:
        return self.labels.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]


class Backend:
    """A way to compute :class:`Problem`.

    Subclasses set ``name`` and ``priority`` (higher wins under ``"auto"``) and implement
    :meth:`availability`, :meth:`accepts` and :meth:`run`.
    """

    name: str = ""
    priority: int = 0
    #: Whether ``"auto"`` may pick it (the reference backend is for tests only).
    auto: bool = True

    def availability(self) -> tuple[bool, str]:
        """Whether the backend's dependencies import here, and if not, why."""
        return True, ""

    def accepts(self, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        """Whether this backend can run tensors of this device and dtype, and if not, why."""
        raise NotImplementedError

    def run(self, problem: Problem) -> torch.Tensor:
        """Return ``[N]`` per-row losses (``"none"``) or the 0-d ``scale * sum`` (``"sum"``).

        The result is differentiable with respect to ``hidden``, ``weight`` and ``bias``
        wherever they require grad and grad mode is on.
        """
        raise NotImplementedError

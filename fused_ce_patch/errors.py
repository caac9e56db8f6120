"""Exceptions raised by fused_ce_patch, importable without torch-heavy modules."""

from __future__ import annotations


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run this call (missing package, wrong device)."""


class UnsupportedModelError(ValueError):
    """``apply_fused_ce`` was given a model whose architecture has no patch."""


class NoLossToFuseError(UnsupportedModelError):
    """The model's ``forward`` takes no labels and computes no loss (an assistant or draft head
    whose caller computes the loss from its logits): there is nothing to fuse in it."""


class LabelOutOfRangeError(ValueError, IndexError):
    """A label outside ``[0, V)`` that is not ``ignore_index``.

    A ``ValueError`` (the contract, DESIGN §5) and an ``IndexError`` (what ``F.cross_entropy``
    raises for it on CPU), so code written against either catches it.
    """


class LogitsNotMaterializedError(RuntimeError):
    """Something used ``outputs.logits`` after the fused loss path, which never builds them."""


def raise_if_double_backward(what: str, remedy: str | None = None) -> None:
    """Call first thing in a custom ``backward``: refuse ``create_graph=True``.

    The fused backwards are not differentiable; autograd would otherwise hand back detached
    gradients silently whenever the upstream gradient does not itself require grad.

    Raises:
        RuntimeError: grad mode is on inside backward (double backward was asked for).
    """
    import torch

    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} does not support double backward (create_graph=True); for higher-order "
            f"gradients " + (remedy or "compute this loss with backend='reference' "
                             "(materialised logits), or call revert_fused_ce(model) on a "
                             "patched model for those steps")
        )


def cuda_graph_capturing(device) -> bool:
    """Whether a CUDA graph is being captured on the current stream, for tensors on
    ``device`` (a ``torch.device``); False for every other device type."""
    import torch

    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def raise_if_capturing(device, what: str) -> None:
    """Refuse to run ``what`` while a CUDA graph is being captured (:func:`cuda_graph_capturing`).

    The fused functions read their labels' range and count on the host: a synchronisation
    that CUDA refuses during capture (its error ends the capture), and a value that a replay
    of the graph would never read again (the next batch would reuse this one's count).

    Raises:
        RuntimeError: a capture is under way; the message names ``what`` and the ways out.
    """
    if cuda_graph_capturing(device):
        raise RuntimeError(
            f"{what} cannot run while a CUDA graph is being captured: it reads the labels' "
            f"range and count on the host, which a replay would not read again. Compute it "
            f"outside the captured region, or use torch.compile(mode='reduce-overhead'), "
            f"which captures CUDA graphs around it")


def single_backward(backward=None, *, what: str = "fused_linear_cross_entropy",
                    remedy: str | None = None):
    """Decorator for a custom ``autograd.Function.backward`` that is not differentiable.

    Unlike ``torch.autograd.function.once_differentiable`` (which hands back detached
    gradients silently when the upstream gradient does not require grad), it raises on
    ``create_graph=True`` (:func:`raise_if_double_backward` with ``what`` and ``remedy``);
    then it runs ``backward`` without building a graph. ``@single_backward`` or
    ``@single_backward(what=..., remedy=...)``.
    """
    import functools

    import torch

    if backward is None:
        return functools.partial(single_backward, what=what, remedy=remedy)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        raise_if_double_backward(what, remedy)
        with torch.no_grad():
            return backward(ctx, *grads)

    return wrapper


class FusedCEFlagError(RuntimeError):
    """``use_fused_ce=True`` reached a Trainer that cannot act on it (raised at construction,
    so the flag is never a silent no-op)."""

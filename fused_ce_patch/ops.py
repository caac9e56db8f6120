"""The fused loss as ``torch.library`` custom ops, so ``torch.compile`` sees one opaque call.

Under Dynamo (``torch.compiler.is_compiling()``), :func:`~fused_ce_patch.fused_linear_cross_entropy`
hands its tensors to ``fused_ce::linear_cross_entropy`` instead of running the backend inline.
Dynamo and Inductor then never trace the validation (one host synchronisation for the label
range and count), the backends' ``.item()`` or the launcher objects: the op has a
fake (meta) implementation that gives the output's shape and dtype, and runs eagerly at run time.
There is no graph break at the loss.

Backward is a second op, ``fused_ce::linear_cross_entropy_backward``, registered with
``register_autograd``. It recomputes the loss with autograd on and differentiates it (the
backends keep their saved state inside their own ``autograd.Function``, which cannot cross an op
boundary), so a compiled step runs the fused forward twice: the memory saving is the same, the
loss costs about one extra forward pass. Eager calls never go through these ops.

Double backward through the op is not supported (as in eager).

Source: PyTorch "Python custom operators" tutorial (``torch.library.custom_op``,
``register_fake``, ``register_autograd``), torch 2.4+.
"""

import numbers
from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from .loss import fused_linear_cross_entropy, register_traced_call

_NAMESPACE = "fused_ce"


def _eager(hidden, weight, bias, labels, num_items_t, num_items_i, num_items_f, ignore_index,
           reduction, shift, softcap, label_smoothing, z_loss, logits_budget, backend):
    num_items = next((n for n in (num_items_t, num_items_i, num_items_f) if n is not None), None)
    return fused_linear_cross_entropy(
        hidden, weight, labels, bias=bias, ignore_index=ignore_index, reduction=reduction,
        num_items_in_batch=num_items,
        shift=shift, softcap=softcap, label_smoothing=label_smoothing, z_loss=z_loss,
        logits_budget=logits_budget, backend=backend,
    )


@custom_op(f"{_NAMESPACE}::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
    num_items_t: Optional[Tensor], num_items_i: Optional[int], num_items_f: Optional[float],
    ignore_index: int, reduction: str, shift: bool, softcap: Optional[float],
    label_smoothing: float, z_loss: float, logits_budget: Optional[int], backend: str,
) -> Tensor:
    """``fused_linear_cross_entropy`` with every option positional (see loss.py)."""
    with torch.no_grad():
        out = _eager(hidden, weight, bias, labels, num_items_t, num_items_i, num_items_f,
                     ignore_index, reduction, shift, softcap, label_smoothing, z_loss,
                     logits_budget, backend)
    return out.clone() if out._base is not None else out  # an op's output may not be a view


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, labels, num_items_t, num_items_i, num_items_f, ignore_index,
      reduction, shift, softcap, label_smoothing, z_loss, logits_budget, backend):
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    shape = labels.shape if reduction == "none" else ()
    return hidden.new_empty(shape, dtype=dtype)


@custom_op(f"{_NAMESPACE}::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
    num_items_t: Optional[Tensor], num_items_i: Optional[int], num_items_f: Optional[float],
    ignore_index: int, reduction: str, shift: bool, softcap: Optional[float],
    label_smoothing: float, z_loss: float, logits_budget: Optional[int], backend: str,
) -> list[Tensor]:
    """``[d hidden, d weight]`` (``+ [d bias]``) of the loss for the upstream gradient ``grad``."""
    inputs = [hidden.detach().requires_grad_(), weight.detach().requires_grad_()]
    if bias is not None:
        inputs.append(bias.detach().requires_grad_())
    with torch.enable_grad():
        out = _eager(*inputs[:2], inputs[2] if bias is not None else None, labels, num_items_t,
                     num_items_i, num_items_f, ignore_index, reduction, shift, softcap,
                     label_smoothing, z_loss, logits_budget, backend)
        if out.grad_fn is None and out._base is not None:
            # Inside an op kernel ADInplaceOrView is force-included, so the reshaping view of
            # reduction="none" is not recorded by autograd; differentiate its flat base.
            out, grad = out._base, grad.reshape(out._base.shape)
        grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]


@linear_cross_entropy_backward.register_fake
def _(grad, hidden, weight, bias, labels, *options):
    out = [torch.empty_like(hidden), torch.empty_like(weight)]
    if bias is not None:
        out.append(torch.empty_like(bias))
    return out


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, num_items_t, *options = inputs
    ctx.save_for_backward(hidden, weight, bias, labels, num_items_t)
    ctx.options = options


def _backward(ctx, grad):
    hidden, weight, bias, labels, num_items_t = ctx.saved_tensors
    grads = linear_cross_entropy_backward(grad, hidden, weight, bias, labels, num_items_t,
                                          *ctx.options)
    d_bias = grads[2] if bias is not None else None
    # no gradient for labels, num_items_t and the options
    return (grads[0], grads[1], d_bias) + (None,) * (2 + len(ctx.options))


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def traced_call(hidden, weight, labels, *, bias, ignore_index, reduction, num_items_in_batch,
                shift, softcap, label_smoothing, z_loss, logits_budget, backend):
    """What :func:`~fused_ce_patch.fused_linear_cross_entropy` does under Dynamo: one op call.

    Options were checked by the caller (types only: a Python ``num_items_in_batch`` may be a
    SymInt or SymFloat here, whose value is known at run time, inside the op); tensors are
    checked when the op runs.
    """
    num_items_t = num_items_i = num_items_f = None
    if isinstance(num_items_in_batch, Tensor):
        num_items_t = num_items_in_batch
    elif isinstance(num_items_in_batch, torch.SymInt):
        num_items_i = num_items_in_batch  # int() would specialise the graph on its value
    elif isinstance(num_items_in_batch, torch.SymFloat):
        num_items_f = num_items_in_batch
    elif isinstance(num_items_in_batch, numbers.Integral):
        num_items_i = int(num_items_in_batch)  # NumPy integers too
    elif num_items_in_batch is not None:
        num_items_f = float(num_items_in_batch)
    return linear_cross_entropy(
        hidden, weight, bias, labels, num_items_t, num_items_i, num_items_f, int(ignore_index),
        reduction, bool(shift), None if softcap is None else float(softcap),
        float(label_smoothing), float(z_loss), logits_budget, backend,
    )


register_traced_call(traced_call)

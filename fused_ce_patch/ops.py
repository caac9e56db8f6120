"""The fused loss as ``torch.library`` custom ops, so ``torch.compile`` sees one opaque call.

Under Dynamo (``torch.compiler.is_compiling()``), :func:`~fused_ce_patch.fused_linear_cross_entropy`
hands its tensors to one of the ops below instead of running the backend inline. Dynamo and
Inductor then never trace the validation (one host synchronisation for the label range and
count), the backends' ``.item()`` or the launcher objects: each op has a fake (meta)
implementation that gives the outputs' shapes and dtypes, and runs eagerly at run time. There
is no graph break at the loss.

- ``fused_ce::linear_cross_entropy_and_grads``, for a scalar loss (``"mean"``/``"sum"``) whose
  gradient is wanted (grad mode on and an input requiring grad, both known when Dynamo traces),
  in bfloat16, float32 or float64:
  it runs the fused forward and backward at once, for an upstream gradient of 1, and returns the
  loss with the gradients of the inputs that require one. Backward only multiplies them by the
  upstream gradient (a pointwise op that Inductor fuses into what follows). So the compiled step
  runs the fused loss once, as eager does, and its backward has no host synchronisation: a
  second label check or a backend's ``.item()`` there would drain the device queue that
  compiled code keeps full. The gradients live from the loss's forward to the start of the
  backward, which is where the step's memory peaks anyway. The product rounds the stored
  gradient a second time when the upstream gradient is not a power of two (at most one unit in
  the last place of its dtype; exact for 1, which ``loss.backward()`` gives), as the eager
  Triton default path does with its forward-time gradient; the CPU ``torch`` backend keeps
  dW and db in float32 until its backward, so there compiled 16-bit dW/db differ from eager
  by that unit for such upstream gradients. Double backward raises where the op's backward
  runs eagerly (Dynamo's ``eager`` backend); in an AOT-compiled graph the stored gradients
  carry no graph back to the inputs, so ``torch.autograd.grad(..., allow_unused=True)`` of a
  second-order term gives None (``.backward()`` raises torch's own "does not currently support
  double backward").
- ``fused_ce::linear_cross_entropy``, for ``reduction="none"``, float16 (whose gradient at an
  upstream gradient of 1 would underflow before a loss scale multiplies it) and calls without
  a gradient.
  Its backward is ``fused_ce::linear_cross_entropy_backward``, registered with
  ``register_autograd``: it recomputes the loss with autograd on and differentiates it (the
  backends keep their saved state inside their own ``autograd.Function``, which cannot cross an
  op boundary), so the fused forward runs twice there.

Eager calls never go through these ops. Double backward through them is not supported (as in
eager).

Each op carries ``torch.Tag.cudagraph_unsafe`` (torch 2.8+): its host read of the labels cannot
run while a CUDA graph is captured, and a replayed graph would keep one batch's label count and
chunking. So ``torch.compile(mode="reduce-overhead")`` captures the rest of the graph around the
op (Inductor's graph partitions) or, without partitioning, skips CUDA graphs for that graph.

Source: PyTorch "Python custom operators" tutorial (``torch.library.custom_op``,
``register_fake``, ``register_autograd``), torch 2.4+.
"""

import contextlib
import inspect
import numbers
from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from .errors import raise_if_double_backward
from .loss import fused_linear_cross_entropy, register_traced_call

_NAMESPACE = "fused_ce"


def _op_tags() -> dict:
    """``custom_op``'s ``tags`` argument: ``cudagraph_unsafe`` where this torch has the tag and
    the argument (see the module docstring), else nothing."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None or "tags" not in inspect.signature(custom_op).parameters:
        return {}
    return {"tags": (tag,)}


_OP_TAGS = _op_tags()


def _eager(hidden, weight, bias, labels, num_items_t, num_items_i, num_items_f, ignore_index,
           reduction, shift, softcap, label_smoothing, z_loss, logits_budget, backend):
    num_items = next((n for n in (num_items_t, num_items_i, num_items_f) if n is not None), None)
    return fused_linear_cross_entropy(
        hidden, weight, labels, bias=bias, ignore_index=ignore_index, reduction=reduction,
        num_items_in_batch=num_items,
        shift=shift, softcap=softcap, label_smoothing=label_smoothing, z_loss=z_loss,
        logits_budget=logits_budget, backend=backend,
    )


_AUTOCAST_KEYS = [k for name, k in torch._C.DispatchKey.__members__.items()
                  if name.startswith("Autocast")]


def _top_level_dispatch():
    """The dispatcher's thread-local key sets of a top-level eager call, inside an op's kernel.

    An op's kernel runs with the autograd keys excluded (and, in a compiled graph, functorch's
    and functionalization's too), so autograd records only ``autograd.Function`` nodes there;
    the loss's degenerate-divisor backward (``backends/nonfinite_scale.py``) differentiates
    stock ops and needs the whole eager dispatcher. Autocast stays as it is (off: the loss
    turns it off anyway). Uses torch's private ``_ForceDispatchKeyGuard`` (as torch's own
    higher-order ops do); without it, the kernel runs as called.
    """
    guard = getattr(torch._C, "_ForceDispatchKeyGuard", None)
    if guard is None:
        return contextlib.nullcontext()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    kept = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
    for key in _AUTOCAST_KEYS:
        if exclude.has(key):
            kept = kept.add(key)
    return guard(torch._C._dispatch_tls_local_include_set(), kept)


def _differentiated(hidden, weight, bias, labels, options, needs_grad, grad=None):
    """The eager loss, run with autograd on inside an op's kernel, and its gradients:
    ``(loss, [d hidden, d weight, d bias])`` for the upstream gradient ``grad`` (None: 1),
    each contiguous whatever its input's strides (as the ops' fakes say), zeros where the loss
    does not depend on it, None where ``needs_grad`` does not ask for it (or bias is None).
    ``options``: ``_eager``'s arguments after ``labels``."""
    wanted = [t.detach().requires_grad_() if t is not None and need else t
              for t, need in zip((hidden, weight, bias), needs_grad)]
    diff = [t for t, need in zip(wanted, needs_grad) if t is not None and need]
    with _top_level_dispatch(), torch.enable_grad():
        out = _eager(*wanted, labels, *options)
        top = out
        if top.grad_fn is None and top._base is not None:
            # Inside an op kernel ADInplaceOrView is force-included, so the reshaping view of
            # reduction="none" is not recorded by autograd; differentiate its flat base.
            top = top._base
            grad = None if grad is None else grad.reshape(top.shape)
        found = (torch.autograd.grad(top, diff, grad, allow_unused=True) if top.requires_grad
                 else [None] * len(diff))
    found = iter(found)
    grads = []
    for t, need in zip(wanted, needs_grad):
        if t is None or not need:
            grads.append(None)
        else:
            g = next(found)
            grads.append(t.new_zeros(t.shape) if g is None else g.contiguous())
    return out, grads


def _loss_dtype(hidden: Tensor) -> torch.dtype:
    """The loss's dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


@custom_op(f"{_NAMESPACE}::linear_cross_entropy", mutates_args=(), **_OP_TAGS)
def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
    num_items_t: Optional[Tensor], num_items_i: Optional[int], num_items_f: Optional[float],
    ignore_index: int, reduction: str, shift: bool, softcap: Optional[float],
    label_smoothing: float, z_loss: float, logits_budget: Optional[int], backend: str,
) -> Tensor:
    """``fused_linear_cross_entropy`` with every option positional (see loss.py)."""
    with _top_level_dispatch(), torch.no_grad():
        out = _eager(hidden, weight, bias, labels, num_items_t, num_items_i, num_items_f,
                     ignore_index, reduction, shift, softcap, label_smoothing, z_loss,
                     logits_budget, backend)
    return out.clone() if out._base is not None else out  # an op's output may not be a view


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, labels, num_items_t, num_items_i, num_items_f, ignore_index,
      reduction, shift, softcap, label_smoothing, z_loss, logits_budget, backend):
    shape = labels.shape if reduction == "none" else ()
    return hidden.new_empty(shape, dtype=_loss_dtype(hidden))


@custom_op(f"{_NAMESPACE}::linear_cross_entropy_backward", mutates_args=(), **_OP_TAGS)
def linear_cross_entropy_backward(
    grad: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
    num_items_t: Optional[Tensor], num_items_i: Optional[int], num_items_f: Optional[float],
    ignore_index: int, reduction: str, shift: bool, softcap: Optional[float],
    label_smoothing: float, z_loss: float, logits_budget: Optional[int], backend: str,
) -> list[Tensor]:
    """``[d hidden, d weight]`` (``+ [d bias]``) of the loss for the upstream gradient ``grad``."""
    options = (num_items_t, num_items_i, num_items_f, ignore_index, reduction, shift, softcap,
               label_smoothing, z_loss, logits_budget, backend)
    _, grads = _differentiated(hidden, weight, bias, labels, options,
                               [True, True, bias is not None], grad)
    return grads[:2] if bias is None else grads


@linear_cross_entropy_backward.register_fake
def _(grad, hidden, weight, bias, labels, *options):
    out = [hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)]
    if bias is not None:
        out.append(bias.new_empty(bias.shape))
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


@custom_op(f"{_NAMESPACE}::linear_cross_entropy_and_grads", mutates_args=(), **_OP_TAGS)
def linear_cross_entropy_and_grads(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
    num_items_t: Optional[Tensor], num_items_i: Optional[int], num_items_f: Optional[float],
    ignore_index: int, reduction: str, shift: bool, softcap: Optional[float],
    label_smoothing: float, z_loss: float, logits_budget: Optional[int], backend: str,
    needs_grad: list[bool],
) -> list[Tensor]:
    """``[loss, d hidden, d weight, d bias]`` for an upstream gradient of 1 (scalar loss).

    ``needs_grad`` says, for hidden, weight and bias, which gradients to compute; the others
    come back as empty tensors (a frozen lm_head, as under LoRA, costs no dW matmul).
    """
    options = (num_items_t, num_items_i, num_items_f, ignore_index, reduction, shift, softcap,
               label_smoothing, z_loss, logits_budget, backend)
    out, grads = _differentiated(hidden, weight, bias, labels, options, needs_grad)
    out = out.detach()
    head = out.clone() if out._base is not None else out  # an op's output may not be a view
    return [head] + [hidden.new_empty(0) if g is None else g for g in grads]


@linear_cross_entropy_and_grads.register_fake
def _(hidden, weight, bias, labels, num_items_t, num_items_i, num_items_f, ignore_index,
      reduction, shift, softcap, label_smoothing, z_loss, logits_budget, backend, needs_grad):
    out = [hidden.new_empty((), dtype=_loss_dtype(hidden))]
    for t, need in zip((hidden, weight, bias), needs_grad):
        out.append(t.new_empty(t.shape) if t is not None and need else hidden.new_empty(0))
    return out


def _setup_grads_context(ctx, inputs, output):
    ctx.needs_grad = inputs[-1]
    ctx.save_for_backward(*output[1:])


def _scaled(grad: Tensor, stored: Tensor) -> Tensor:
    """``grad * stored`` computed in the loss's precision, rounded once to ``stored``'s dtype."""
    if stored.dtype == grad.dtype:
        return stored * grad
    return (stored.to(grad.dtype) * grad).to(stored.dtype)


def _backward_from_grads(ctx, grads):
    # The stored gradients carry no graph back to the inputs: a second-order gradient would
    # come back None or zero without a word.
    raise_if_double_backward("fused_linear_cross_entropy")
    grad, stored = grads[0], ctx.saved_tensors  # the stored gradients' own grads are unused
    d = [_scaled(grad, s) if need else None for s, need in zip(stored, ctx.needs_grad)]
    # no gradient for labels, num_items_t and the options
    return (d[0], d[1], d[2]) + (None,) * 13


linear_cross_entropy_and_grads.register_autograd(
    _backward_from_grads, setup_context=_setup_grads_context
)


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
    args = (hidden, weight, bias, labels, num_items_t, num_items_i, num_items_f,
            int(ignore_index), reduction, bool(shift), None if softcap is None else float(softcap),
            float(label_smoothing), float(z_loss), logits_budget, backend)
    # All known when Dynamo traces (it guards on grad mode, requires_grad and dtypes). float16
    # gradients formed at an upstream gradient of 1 would underflow before a loss scale
    # multiplies them, so float16 forms them in backward, at the real scale (as eager does).
    needs_grad = [t is not None and t.requires_grad for t in (hidden, weight, bias)]
    if (reduction != "none" and torch.is_grad_enabled() and any(needs_grad)
            and hidden.dtype != torch.float16):
        return linear_cross_entropy_and_grads(*args, needs_grad)[0]
    return linear_cross_entropy(*args)


register_traced_call(traced_call)

"""A final-logit softcap written as a call, read from the callee's live source.

Some causal LMs cap their logits through a module or a helper function instead of writing
``tanh(logits / c) * c`` in ``forward``: Inkling2's ``logits = self.logit_softcap(logits)``
(``Inkling2Softcap.forward``: ``return torch.tanh(x / self.softcap) * self.softcap``) and xLSTM's
``logits = soft_cap(logits, self.config.output_logit_soft_cap)`` (``if cap is None: return x``,
then ``return cap * torch.tanh(x / cap)``). The rewrite (:mod:`.architectures`) records such a
call; at each call :func:`callable_softcap` reads the callee as it is then — its class's
``forward`` or the function object the forward's globals hold — and gives the cap ``c`` only
when the source is exactly one of those forms, with ``torch`` the real module and no hook on the
module. The source read must be what runs (:mod:`.source_check`): no decorator (a
``functools.wraps`` wrapper's source reads as the function it wraps), no closure variables, code
equal to the source file's now, and for a module nn.Module's own call around its ``forward``.
Anything else makes the call compute the real logits (the stock statement itself).
"""

from __future__ import annotations

import ast
import functools
import types

import torch
from torch import nn

from .head import _own_call
from .source_check import parse_def, same_code


@torch.compiler.disable  # reads sources and module state: an eager graph break, not traced
def callable_softcap(kind: str, value):
    """``(cap, None)`` for a softcap call the fused loss can express, else ``(None, reason)``.

    Args:
        kind: ``"capcall"`` (``value`` is the module called on the logits) or ``"capfn"``
            (``value`` is ``(function, cap_argument)``).
        value: as above, evaluated by the rewritten forward at this call.

    Returns:
        ``(c, None)``: the call computes ``c * tanh(logits / c)``; ``(None, None)``: the call
        returns the logits unchanged (a guarded function given ``None``); ``(None, reason)``:
        the call is something else (the logits are then computed for real).
    """
    if kind == "capcall":
        module = value
        name = type(module).__name__
        if not isinstance(module, nn.Module):
            return None, f"its logit transform {name} is not a module"
        if (module._forward_pre_hooks or module._forward_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in module.__dict__):
            return None, f"its softcap module {name} has hooks or a replaced forward"
        if _own_call(module):  # a __call__ of its own runs around forward
            return None, f"its softcap module {name}'s call is not nn.Module's"
        attr = _module_form(type(module).forward)
        if attr is None:
            return None, f"{name}.forward is not `torch.tanh(x / self.c) * self.c`"
        cap = getattr(module, attr, None)
        if cap is None:
            return None, f"its softcap module {name} has {attr}=None"
        return cap, None
    fn, cap = value
    form = _function_form(fn) if isinstance(fn, types.FunctionType) else None
    if form is None:
        return None, f"{getattr(fn, '__qualname__', fn)!r} on its logits is not a softcap " \
                     f"it can read"
    if cap is None:
        return (None, None) if form == "guarded" else (None, "its softcap operand is None")
    return cap, None


def _parse(fn):
    """``(parameter names, body)`` of the plain function ``fn`` whose source is what runs, else
    None: a decorated function (``inspect.getsource`` reads the function a ``functools.wraps``
    wrapper wraps, not the wrapper), one with closure variables (``torch`` may name something
    else there) or one whose code is not its source file's (changed since import) is not read."""
    if not isinstance(fn, types.FunctionType) or hasattr(fn, "__wrapped__") \
            or fn.__code__.co_freevars:
        return None
    node = parse_def(fn)
    if node is None or node.decorator_list or fn.__globals__.get("torch") is not torch \
            or not same_code(node, fn):
        return None
    args = node.args
    if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs or len(args.args) != 2:
        return None
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    return [a.arg for a in args.args], body


def _is_name(node, name) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _capped(expr, x: str, same_cap) -> bool:
    """``torch.tanh(x / C) * C`` or ``C * torch.tanh(x / C)``, ``same_cap(C)`` for both C."""
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult)):
        return False
    for call, cap in ((expr.left, expr.right), (expr.right, expr.left)):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "tanh" and _is_name(call.func.value, "torch")
                and len(call.args) == 1 and not call.keywords):
            continue
        inner = call.args[0]
        if (isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Div)
                and _is_name(inner.left, x) and same_cap(inner.right) and same_cap(cap)):
            return True
    return False


@functools.lru_cache(maxsize=64)
def _module_form_of(fn, code) -> str | None:
    parsed = _parse(fn)
    if parsed is None:
        return None
    (this, x), body = parsed
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return None
    attrs = set()

    def self_attr(node) -> bool:
        ok = isinstance(node, ast.Attribute) and _is_name(node.value, this)
        if ok:
            attrs.add(node.attr)
        return ok

    if not _capped(body[0].value, x, self_attr) or len(attrs) != 1:
        return None
    return attrs.pop()


def _module_form(fn) -> str | None:
    """The attribute ``c`` of a module forward ``return torch.tanh(x / self.c) * self.c``."""
    return _module_form_of(fn, getattr(fn, "__code__", None))


@functools.lru_cache(maxsize=64)
def _function_form_of(fn, code) -> str | None:
    parsed = _parse(fn)
    if parsed is None:
        return None
    (x, c), body = parsed
    guarded = False
    if len(body) == 2:
        test = body[0]
        if not (isinstance(test, ast.If) and not test.orelse and len(test.body) == 1
                and isinstance(test.test, ast.Compare) and _is_name(test.test.left, c)
                and len(test.test.ops) == 1 and isinstance(test.test.ops[0], ast.Is)
                and isinstance(test.test.comparators[0], ast.Constant)
                and test.test.comparators[0].value is None
                and isinstance(test.body[0], ast.Return) and _is_name(test.body[0].value, x)):
            return None
        guarded, body = True, body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return None
    if not _capped(body[0].value, x, lambda node: _is_name(node, c)):
        return None
    return "guarded" if guarded else "plain"


def _function_form(fn) -> str | None:
    """``"guarded"`` for ``def f(x, c): if c is None: return x; return c * torch.tanh(x / c)``,
    ``"plain"`` without the guard, else None."""
    return _function_form_of(fn, fn.__code__)

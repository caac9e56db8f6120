"""A head with a transform before the vocabulary projection: the projection's input, exactly.

RoBERTa-family, BERT-family and BERT-generation causal LMs call a head *module* that is not the
output projection but contains it: ``logits = self.lm_head(h)`` where ``lm_head`` runs
``dense -> gelu -> layer_norm -> decoder`` (``decoder`` is ``get_output_embeddings()``), or
``logits = self.cls(h)`` where ``cls`` calls ``predictions``, which runs ``transform`` then
``decoder``. The fused loss takes the input of that final ``nn.Linear``.

:func:`resolve` walks from the head module down to the projection. Every module on the way
must have a class ``forward`` whose source (:mod:`ast`) ends in the call of the next module
on the path, its result returned unchanged — ``return self.child(x)``, or ``y =
self.child(x)`` then ``return y`` — with no other ``return`` (nor ``yield``, nested
definitions, ``super()``) anywhere in it. Of each such forward a *prefix* copy is compiled
(with the function's own globals, defaults and keyword defaults; nothing added to any module):
the same code with that last call replaced by the next level's prefix on the same argument,
and at the last level by the argument itself, the projection's input. So ``prefix(head, h)``
runs, statement for statement, the code the head's call runs before the projection (the
transform's own submodules are called normally: their hooks, adapters and dropout run), and
``projection(prefix(head, h))`` is the stock ``head(h)``.

That equality needs the modules on the path (not the projection, which :mod:`.head` checks)
to be called by ``nn.Module.__call__`` with nothing around ``forward``: no forward, pre- or
backward hooks (their own or torch's process-wide ones), no forward replaced on the instance,
no ``__call__`` of their own, and a class ``forward`` whose compiled code is the code of the
source that was read. :func:`resolve` reports the first of these that does not hold; the
patched forward then runs the stock head call (:mod:`.forward`), and ``apply_fused_ce``
refuses a head whose forwards do not have the shape above.

A forward may also end in ``return apply_chunking_to_forward(self.<method>, size, dim, x)``
(transformers' own function, checked by identity): a position-wise method applied chunk by
chunk along the sequence gives the values of one call, so the path continues into that method
of the same module (Reformer's ``ReformerOnlyLMHead.forward_chunk``).

Source: transformers 5.25 ``RobertaLMHead``, ``BertOnlyMLMHead`` / ``BertLMPredictionHead``,
``BertGenerationOnlyLMHead``, ``ReformerOnlyLMHead`` for the shapes accepted.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import textwrap
import types
from dataclasses import dataclass

from torch import nn

from ..errors import UnsupportedModelError
from .head import _global_hooks, _own_call
from .source_check import parse_def, same_code

#: The factory parameter of a prefix copy: the next level's prefix (closure variable).
NEXT = "__fused_ce_next__"
#: Modules from the head module down to the projection, at most.
MAX_DEPTH = 8


@dataclass(frozen=True)
class _Level:
    """One analysed head forward: ``child`` is the attribute whose call ends it — a submodule,
    or, for ``method``, a method of the same module called through transformers'
    ``apply_chunking_to_forward`` (Reformer's ``forward_chunk``)."""

    child: str
    make: object  # make(next) -> the prefix copy of the forward, calling next(self.child, x)
    digest: str  # sha256 of its source (16 hex digits)
    method: bool = False


@dataclass(frozen=True)
class HeadPath:
    """How the head module reaches the projection.

    Attributes:
        names: dotted attribute path from the model to each module on the way, the head
            module first, the projection last (``("cls", "cls.predictions",
            "cls.predictions.decoder")``), for messages.
        forwards: the class ``forward`` of each module on the way but the projection, in order:
            what was analysed.
        prefix: ``prefix(head, hidden) -> projection input`` (the head's call up to the
            projection; same arguments as the head's call).
        fingerprint: sha256 (16 hex digits) of the analysed forwards' sources.
    """

    names: tuple[str, ...]
    forwards: tuple
    prefix: object
    fingerprint: str


def _where(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _child_call(node):
    """``(attr, arg)`` of ``self.<attr>(arg)`` (one positional argument), else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
            and len(node.args) == 1 and not node.keywords
            and not isinstance(node.args[0], ast.Starred)):
        return None
    return node.func.attr, node.args[0]


def _chunked_call(node):
    """``(method, arg)`` of ``apply_chunking_to_forward(self.<method>, size, dim, arg)``, else
    None (the caller checks that the name is transformers' function)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "apply_chunking_to_forward" and len(node.args) == 4
            and not node.keywords and isinstance(node.args[0], ast.Attribute)
            and isinstance(node.args[0].value, ast.Name) and node.args[0].value.id == "self"
            and not isinstance(node.args[3], ast.Starred)):
        return None
    return node.args[0].attr, node.args[3]


def _shape(fn_def: ast.FunctionDef, where: str):
    """``(attr, arg, body, method)`` of a forward that ends by returning ``self.<attr>(arg)``
    (``method`` False) or ``apply_chunking_to_forward(self.<attr>, size, dim, arg)`` (True):
    ``body`` is every statement before that call. Raises UnsupportedModelError naming the
    statement."""
    args = fn_def.args
    if not args.args or args.args[0].arg != "self" or args.posonlyargs:
        raise UnsupportedModelError(f"{where}: not a method of (self, ...)")
    body = list(fn_def.body)
    last = body[-1]
    if not isinstance(last, ast.Return) or last.value is None:
        raise UnsupportedModelError(
            f"{where}: does not end in `return self.<module>(x)` "
            f"(ends in `{ast.unparse(last).splitlines()[0]}`)")
    found, method = _child_call(last.value), False
    if found is None and _chunked_call(last.value) is not None:
        # a position-wise function applied chunk by chunk along the sequence: the same values
        # as one call on every position
        found, method = _chunked_call(last.value), True
    if found is not None:
        body = body[:-1]
    elif (isinstance(last.value, ast.Name) and len(body) >= 2
          and isinstance(body[-2], ast.Assign) and len(body[-2].targets) == 1
          and isinstance(body[-2].targets[0], ast.Name)
          and body[-2].targets[0].id == last.value.id):
        found = _child_call(body[-2].value)
        if found is None:
            raise UnsupportedModelError(
                f"{where}: its result is not the call of one submodule: "
                f"`{ast.unparse(body[-2]).splitlines()[0]}`")
        body = body[:-2]
    else:
        raise UnsupportedModelError(
            f"{where}: does not return the call of one submodule: "
            f"`{ast.unparse(last).splitlines()[0]}`")
    for stmt in body:
        for node in ast.walk(stmt):
            bad = None
            if isinstance(node, ast.Return):
                bad = "returns early"
            elif isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)):
                bad = "is a generator or coroutine"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                   ast.ClassDef)):
                bad = "defines a function or class"
            elif isinstance(node, ast.Name) and node.id in ("super", "__class__"):
                bad = "calls super()"
            if bad is not None:
                raise UnsupportedModelError(
                    f"{where} {bad} (`{ast.unparse(stmt).splitlines()[0]}`), so its result is "
                    f"not the projection's output alone")
    return found[0], found[1], body, method


def _analyse(fn) -> _Level | str:
    """The :class:`_Level` of the class forward ``fn``, or why it does not fit (a message).
    Cached per function *and* code object: a ``__code__`` replaced in place (IPython's
    ``%autoreload``, hot-reload tools) is analysed again."""
    return _analyse_code(fn, getattr(fn, "__code__", None))


@functools.lru_cache(maxsize=None)
def _analyse_code(fn, code) -> _Level | str:
    where = _where(fn)
    if not isinstance(fn, types.FunctionType):
        return f"{where} is a {type(fn).__name__}, not a plain function"
    if hasattr(fn, "__wrapped__"):
        return f"{where} is wrapped by a decorator, which its prefix copy would not run"
    if fn.__code__.co_freevars:
        return f"{where} closes over {', '.join(fn.__code__.co_freevars)}"
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        return f"{where}: source not available ({exc})"
    fn_def = parse_def(fn)  # the source as written (string constants undedented)
    if fn_def is None or fn_def.decorator_list:
        return f"{where}: not an undecorated def"
    if not same_code(fn_def, fn):
        return f"{where}: its code is not the code of its source file (changed since import?)"
    try:
        attr, arg, body, method = _shape(fn_def, where)
    except UnsupportedModelError as exc:
        return str(exc)
    if method and fn.__globals__.get("apply_chunking_to_forward") is not _chunking():
        return f"{where}: its apply_chunking_to_forward is not transformers'"
    this = ast.Name(id="self", ctx=ast.Load())
    fn_def.body = [*body, ast.Return(value=ast.Call(
        func=ast.Name(id=NEXT, ctx=ast.Load()),
        args=[this if method else ast.Attribute(value=this, attr=attr, ctx=ast.Load()), arg],
        keywords=[]))]
    fn_def.decorator_list = []
    factory = ast.parse(f"def __fused_ce_head_factory__({NEXT}):\n    pass\n").body[0]
    factory.body = [fn_def, ast.Return(value=ast.Name(id=fn_def.name, ctx=ast.Load()))]
    module = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(module)
    code = compile(module, f"<fused_ce_patch head prefix of {where}>", "exec")
    factory_code = next(c for c in code.co_consts
                        if isinstance(c, types.CodeType) and c.co_name == factory.name)
    maker = types.FunctionType(factory_code, fn.__globals__)

    def make(next_prefix):
        prefix = maker(next_prefix)
        prefix.__defaults__, prefix.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
        prefix.__qualname__ = f"{fn.__qualname__}<prefix>"
        return prefix

    return _Level(attr, make, hashlib.sha256(source.encode()).hexdigest()[:16], method)


def _chunking():
    from transformers.pytorch_utils import apply_chunking_to_forward

    return apply_chunking_to_forward


def _projection_input(module, x):
    """The last level's "next": the projection's input itself."""
    return x


def _prefix_of(forwards: tuple):
    """The composed prefix of the analysed ``forwards`` (outermost first)."""
    return _prefix_of_code(tuple((fn, getattr(fn, "__code__", None)) for fn in forwards))


@functools.lru_cache(maxsize=64)
def _prefix_of_code(forwards: tuple):
    prefix = _projection_input
    for fn, code in reversed(forwards):
        prefix = _analyse_code(fn, code).make(prefix)
    return prefix


def _called_as_stock(module: nn.Module) -> str | None:
    """Why calling ``module`` would run more than its class ``forward``, or None."""
    name = type(module).__name__
    if module._forward_hooks or module._forward_pre_hooks:
        return f"{name} has forward hooks"
    if module._backward_hooks or module._backward_pre_hooks:
        return f"{name} has backward hooks"
    if "forward" in module.__dict__:
        return f"{name}.forward was replaced on the instance"
    if _own_call(module):
        return f"{name}'s call is not nn.Module's (a __call__ of its own, or compiled)"
    return None


def resolve(head: nn.Module, projection: nn.Module, name: str = "lm_head") -> HeadPath | str:
    """The :class:`HeadPath` from ``head`` down to ``projection``, or why the fused loss cannot
    take the projection's input from this head now (a message).

    Args:
        head: the module the causal LM's forward calls as its head (``self.lm_head``).
        projection: ``model.get_output_embeddings()``, a module inside ``head``.
        name: how messages name ``head`` (``lm_head``, ``cls``).
    """
    if not isinstance(head, nn.Module):
        return f"{name} is a {type(head).__name__}, not a module"
    everywhere = _global_hooks()
    if everywhere:
        return f"torch's process-wide module {everywhere} hooks are registered"
    module, names, forwards = head, [name], []
    for _ in range(MAX_DEPTH):
        odd = _called_as_stock(module)
        if odd is not None:
            return f"its head module {names[-1]} ({odd})"
        fn = type(module).forward
        level = _analyse(fn)
        while not isinstance(level, str) and level.method:  # same module, one of its methods
            forwards.append(fn)
            names.append(f"{names[-1]}.{level.child}()")
            fn = getattr(type(module), level.child, None)
            if len(forwards) > MAX_DEPTH or not isinstance(fn, types.FunctionType):
                return f"{names[-1]} is not a plain method of {type(module).__name__}"
            level = _analyse(fn)
        if isinstance(level, str):
            return level
        child = module._modules.get(level.child)
        names.append(f"{names[-1]}.{level.child}")
        forwards.append(fn)
        if child is not None and getattr(module, level.child, None) is not child:
            return f"{names[-1]} is shadowed by another attribute of that name"
        if child is projection:
            digest = hashlib.sha256(
                "\0".join(_analyse(f).digest for f in forwards).encode()).hexdigest()[:16]
            return HeadPath(tuple(names), tuple(forwards), _prefix_of(tuple(forwards)), digest)
        if child is None:
            return (f"{_where(fn)} ends in self.{level.child}(...), which is not a submodule "
                    f"of {names[-2]}")
        module = child
    return (f"{name} does not reach get_output_embeddings() within {MAX_DEPTH} modules "
            f"({' -> '.join(names)})")


def head_path(model: nn.Module, head_attr: str, projection: nn.Module) -> HeadPath:
    """:func:`resolve` of ``model.<head_attr>``, raising where it gives a reason (used at
    apply time).

    Raises:
        UnsupportedModelError: the head module's call is not a transform followed by the
            projection in the form described in this module (the message names the forward
            and the statement).
    """
    head = getattr(model, head_attr, None)
    if not isinstance(head, nn.Module) or not any(m is projection for m in head.modules()):
        raise UnsupportedModelError(
            f"fused_ce_patch cannot patch {type(model).__name__}: its forward calls "
            f"self.{head_attr} ({type(head).__name__}), which neither is nor contains "
            f"get_output_embeddings() ({type(projection).__name__})")
    found = resolve(head, projection, head_attr)
    if isinstance(found, str):
        raise UnsupportedModelError(
            f"fused_ce_patch cannot patch {type(model).__name__}: its forward calls "
            f"self.{head_attr}, which is not get_output_embeddings() "
            f"({type(projection).__name__}) and whose call cannot be split into a transform "
            f"followed by that projection: {found}")
    return found

"""Deriving, from a causal-LM class's own ``forward`` source, how to compute its loss fused.

Every causal LM in transformers ends its ``forward`` the same way: the decoder's last hidden
states, sliced by ``logits_to_keep``, go through the head (``self.lm_head(...)``), an optional
logit transform, and ``self.loss_function(logits, labels, vocab_size, **kwargs)``; after that
come extra loss terms (the MoE router aux loss) and the output object. :func:`derive_spec` reads
that source (``inspect.getsource`` + :mod:`ast`) and accepts a class only when every statement
between the head call and the loss call is a transform it knows:

- multiplier: ``logits = logits * E`` or ``logits *= E`` (Cohere ``logit_scale``, Falcon-H1
  ``lm_head_multiplier``, ...);
- divisor: ``logits = logits / E`` (Granite / MiniCPM3 ``logits_scaling``);
- final-logit softcap: ``logits / E``, ``torch.tanh``, ``* E`` (Gemma 2/3/4
  ``final_logit_softcapping``), optionally under ``if E is not None:``;
- ``logits.float()`` (a no-op for the loss: ``ForCausalLMLoss`` upcasts anyway).

It then compiles a copy of that forward in which only those statements change: the head call
defers (no logits), each transform is recorded, and the loss call goes to the fused loss
(:func:`~fused_ce_patch.hf.forward.fused_head_loss`). Everything else — decoder call, slicing,
MoE aux loss (``loss += router_aux_loss_coef * aux_loss``), multimodal inputs, output class and
fields, decorators — is the stock code, unchanged. A class whose source does not fit raises
:class:`~fused_ce_patch.errors.UnsupportedModelError` naming the statement; a class that fits is
still refused by ``apply_fused_ce`` until the parity sweep (:mod:`.sweep`) has proven it
(:mod:`.verified`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import sys
import textwrap
from dataclasses import dataclass, field

from ..errors import UnsupportedModelError

# Names the rewritten forward calls; injected into its globals (see forward.py).
DEFER = "__fused_ce_defer__"
TRANSFORM = "__fused_ce_transform__"
LOSS = "__fused_ce_loss__"
DONE = "__fused_ce_done__"


@dataclass(frozen=True)
class ClassRef:
    """One of the original five rows (kept for ``apply_fused_ce_to_<type>()``)."""

    model_type: str
    module: str
    class_name: str

    def model_class(self):
        """The transformers class of this row (imports its modeling module)."""
        return getattr(importlib.import_module(self.module), self.class_name)


#: The five architectures with a named class-level patcher (public API since 0.1).
ARCHITECTURES: dict[str, ClassRef] = {
    ref.model_type: ref
    for ref in (
        ClassRef("llama", "transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
        ClassRef("qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
        ClassRef("mistral", "transformers.models.mistral.modeling_mistral", "MistralForCausalLM"),
        ClassRef("gemma2", "transformers.models.gemma2.modeling_gemma2", "Gemma2ForCausalLM"),
        ClassRef("gemma3_text", "transformers.models.gemma3.modeling_gemma3", "Gemma3ForCausalLM"),
    )
}


@dataclass(frozen=True)
class ArchSpec:
    """What :func:`derive_spec` found in one class's ``forward``.

    Attributes:
        class_name: ``__name__`` of the class whose ``forward`` was read (the defining class).
        module: its module.
        head_attr: attribute called as the head (``lm_head``); must be
            ``get_output_embeddings()`` at apply time.
        transform: the logit transform, in order, e.g. ``("mul self.logit_scale",)`` or
            ``("softcap self.config.final_logit_softcapping",)``; empty for none.
        moe_aux: the forward adds a router aux loss after the loss call.
        source_hash: sha256 (16 hex digits) of the forward's source — the key under which the
            sweep's proof is stored (same source, same rewrite, same proof).
        stock: the stock forward (decorated, as found on the class).
        rewritten: the compiled rewritten forward (decorated like the stock one).
    """

    class_name: str
    module: str
    head_attr: str
    transform: tuple[str, ...]
    moe_aux: bool
    source_hash: str
    stock: object = field(compare=False, repr=False)
    rewritten: object = field(compare=False, repr=False)

    @property
    def transform_name(self) -> str:
        """``none``, ``multiplier``, ``divisor``, ``softcap`` or a ``+``-joined sequence."""
        kinds = {"mul": "multiplier", "div": "divisor", "softcap": "softcap"}
        return "+".join(kinds[t.split()[0]] for t in self.transform) or "none"


def _is_self_attr(node, attr=None) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and (attr is None or node.attr == attr)
    )


def _is_name(node, name) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _contains_loss_call(node) -> bool:
    return any(
        isinstance(n, ast.Call) and _is_self_attr(n.func, "loss_function") for n in ast.walk(node)
    )


_HEAD_NAMES = ("output", "embed_out", "lm_output", "output_layer")


def _head_expr(node):
    """``(head_attr, arg, ops)`` for ``self.<head>(arg)`` followed by ``.float()`` /
    ``.contiguous()`` / ``* E`` / ``/ E`` in one expression; else None."""
    ops = []
    while True:
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            ops.append(("mul" if isinstance(node.op, ast.Mult) else "div", node.right))
            node = node.left
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("float", "contiguous") and not node.args
              and not node.keywords):
            node = node.func.value
        else:
            break
    if not (isinstance(node, ast.Call) and _is_self_attr(node.func)):
        return None
    attr = node.func.attr
    if len(node.args) != 1 or node.keywords or ("head" not in attr and attr not in _HEAD_NAMES):
        return None
    return attr, node.args[0], ops[::-1]


def _head_call(stmt):
    """``(target, head_attr, arg, ops)`` for ``X = self.<head>(arg)[...]``, else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)):
        return None
    found = _head_expr(stmt.value)
    return None if found is None else (stmt.targets[0].id, *found)


def _transform_op(stmt, name):
    """One logit-transform statement on ``name`` as ``(kind, expr)``, else None.

    ``kind`` is ``mul``, ``div``, ``tanh`` or ``float`` (no-op).
    """
    if isinstance(stmt, ast.AugAssign) and _is_name(stmt.target, name):
        if isinstance(stmt.op, ast.Mult):
            return "mul", stmt.value
        if isinstance(stmt.op, ast.Div):
            return "div", stmt.value
        return None
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and _is_name(stmt.targets[0], name)):
        return None
    value = stmt.value
    if isinstance(value, ast.BinOp) and _is_float_of(value.left, name):
        value = ast.BinOp(left=ast.Name(id=name, ctx=ast.Load()), op=value.op, right=value.right)
    if isinstance(value, ast.BinOp):
        if isinstance(value.op, ast.Mult):
            if _is_name(value.left, name) and not _mentions(value.right, name):
                return "mul", value.right
            if _is_name(value.right, name) and not _mentions(value.left, name):
                return "mul", value.left
        if isinstance(value.op, ast.Div) and _is_name(value.left, name) \
                and not _mentions(value.right, name):
            return "div", value.right
        return None
    if isinstance(value, ast.Call):
        f = value.func
        if (isinstance(f, ast.Attribute) and f.attr == "tanh" and len(value.args) == 1
                and _is_name(value.args[0], name) and not value.keywords):
            return "tanh", None  # torch.tanh(logits) / nn.functional.tanh(logits)
        if (isinstance(f, ast.Attribute) and _is_name(f.value, name) and not value.args
                and not value.keywords):
            if f.attr == "tanh":
                return "tanh", None
            if f.attr == "float":
                return "float", None
    return None


def _is_float_of(node, name) -> bool:
    """``name.float()`` (a no-op for the loss: ForCausalLMLoss upcasts to float32 anyway)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "float" and _is_name(node.func.value, name)
            and not node.args and not node.keywords)


def _mentions(node, name) -> bool:
    return any(_is_name(n, name) for n in ast.walk(node))


def _collapse(ops, where):
    """``[(kind, expr)]`` with ``div E, tanh, mul E`` folded into ``softcap E``; no bare tanh."""
    out, i = [], 0
    while i < len(ops):
        kind, expr = ops[i]
        if kind == "float":
            i += 1
            continue
        if (kind == "div" and i + 2 < len(ops) and ops[i + 1][0] == "tanh"
                and ops[i + 2][0] == "mul" and ast.dump(ops[i + 2][1]) == ast.dump(expr)):
            out.append(("softcap", expr))
            i += 3
            continue
        if kind == "tanh":
            raise UnsupportedModelError(f"{where}: tanh on the logits that is not a softcap")
        out.append((kind, expr))
        i += 1
    seen_softcap = False
    for kind, _ in out:
        if kind == "softcap":
            if seen_softcap:
                raise UnsupportedModelError(f"{where}: two softcaps on the logits")
            seen_softcap = True
        elif seen_softcap:
            raise UnsupportedModelError(f"{where}: a logit scale after the softcap")
    return out


def _conditional_ops(stmt, name, where):
    """``if E is not None: <transform statements>`` whose ops all use ``E``; else None."""
    if not isinstance(stmt, ast.If) or stmt.orelse:
        return None
    test = stmt.test
    if (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None):
        guarded = test.left
    elif isinstance(test, (ast.Attribute, ast.Name, ast.NamedExpr)):
        guarded = test  # `if self.config.final_logit_softcapping:` (None or 0 both mean off)
    else:
        return None
    # `if (c := self.config....) is not None:` — the ops use `c`; the recorded op evaluates
    # the walrus itself so `c` is bound exactly as in the stock code.
    walrus = guarded if isinstance(guarded, ast.NamedExpr) else None
    if walrus is not None:
        guarded = walrus.target
    ops = []
    for inner in stmt.body:
        op = _transform_op(inner, name)
        if op is None:
            return None
        ops.append(op)
    ops = _collapse(ops, where)
    if not ops or any(ast.unparse(expr) != ast.unparse(guarded) for _, expr in ops):
        return None
    if walrus is not None:
        ops = [(kind, walrus) for kind, _ in ops]
    return ops


def _call(func: str, *args) -> ast.Call:
    return ast.Call(func=ast.Name(id=func, ctx=ast.Load()), args=list(args), keywords=[])


def _assign(name: str, value) -> ast.Assign:
    return ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=value)


def _defining_class(cls: type):
    for klass in cls.__mro__:
        if "forward" in klass.__dict__:
            return klass
    raise UnsupportedModelError(f"{cls.__name__} has no forward")


@functools.lru_cache(maxsize=None)
def _derive(klass: type, stock) -> ArchSpec:
    where = f"{klass.__name__}.forward"
    raw = inspect.unwrap(stock)
    try:
        source = textwrap.dedent(inspect.getsource(raw))
    except (OSError, TypeError) as exc:
        raise UnsupportedModelError(f"{where}: source not available ({exc})") from None
    tree = ast.parse(source)
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef):
        raise UnsupportedModelError(f"{where}: not a plain function")
    if any(_is_name(n, "super") or _is_name(n, "__class__") for n in ast.walk(fn)):
        raise UnsupportedModelError(f"{where}: calls super(), cannot be recompiled")
    body = fn.body
    head_at = next((i for i, s in enumerate(body) if _head_call(s)), None)
    if head_at is None:
        raise UnsupportedModelError(f"{where}: no top-level `logits = self.lm_head(hidden)`")
    name, head_attr, arg, head_ops = _head_call(body[head_at])
    loss_at = next((i for i in range(head_at + 1, len(body)) if _contains_loss_call(body[i])),
                   None)
    if loss_at is None:
        raise UnsupportedModelError(f"{where}: no `self.loss_function(...)` after the head")
    if sum(_contains_loss_call(s) for s in body) != 1:
        raise UnsupportedModelError(f"{where}: more than one self.loss_function call")

    # The transform statements between head and loss.
    ops, new_between = list(head_ops), []
    for stmt in body[head_at + 1:loss_at]:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and _is_name(stmt.targets[0], "loss") and isinstance(stmt.value, ast.Constant)
                and stmt.value.value is None):
            new_between.append(stmt)
            continue
        op = _transform_op(stmt, name)
        if op is not None:
            ops.append(op)
            continue
        cond = _conditional_ops(stmt, name, where)
        if cond is not None:
            ops.extend(("softcap?" if k == "softcap" else k + "?", e) for k, e in cond)
            continue
        raise UnsupportedModelError(
            f"{where}: unknown statement between the head and the loss: "
            f"`{ast.unparse(stmt).splitlines()[0]}`"
        )
    plain = [(k.rstrip("?"), e) for k, e in ops]
    transform = _collapse(plain, where)
    # Record every op on the deferred logits, in order (conditional ones skip None/0 at run).
    recorded = []
    i = 0
    folded = []
    while i < len(ops):
        kind, expr = ops[i]
        base = kind.rstrip("?")
        if base == "float":
            i += 1
            continue
        if (base == "div" and i + 2 < len(ops) and ops[i + 1][0].rstrip("?") == "tanh"
                and ops[i + 2][0].rstrip("?") == "mul"):
            folded.append(("softcap", expr, kind.endswith("?")))
            i += 3
            continue
        folded.append((base, expr, kind.endswith("?")))
        i += 1
    for kind, expr, optional in folded:
        recorded.append(_assign(name, _call(
            TRANSFORM, ast.Name(id=name, ctx=ast.Load()), ast.Constant(kind), expr,
            ast.Constant(optional),
        )))

    # The loss statement: `loss = self.loss_function(logits, labels, ...)`, possibly under
    # `if labels is not None:`; its first argument must be the head's output.
    loss_stmt = body[loss_at]
    inner = loss_stmt
    if isinstance(loss_stmt, ast.If):
        if len(loss_stmt.body) != 1 or loss_stmt.orelse:
            raise UnsupportedModelError(f"{where}: the loss block does more than the loss call")
        inner = loss_stmt.body[0]
    if not (isinstance(inner, ast.Assign) and isinstance(inner.value, ast.Call)
            and _is_self_attr(inner.value.func, "loss_function")):
        raise UnsupportedModelError(
            f"{where}: the loss is not `loss = self.loss_function(...)`: "
            f"`{ast.unparse(inner).splitlines()[0]}`"
        )
    call = inner.value
    first = call.args[0] if call.args else next(
        (k.value for k in call.keywords if k.arg == "logits"), None)
    if not _is_name(first, name):
        raise UnsupportedModelError(f"{where}: the loss is not computed from `{name}`")
    if not any(k.arg is None for k in call.keywords):
        raise UnsupportedModelError(
            f"{where}: the loss call does not pass **kwargs (num_items_in_batch, shift_labels)"
        )
    call.func = ast.Name(id=LOSS, ctx=ast.Load())
    tail = body[loss_at + 1:]
    if any(_is_self_attr(n, head_attr) for s in tail for n in ast.walk(s)):
        raise UnsupportedModelError(f"{where}: uses self.{head_attr} again after the loss")
    moe_aux = any(
        isinstance(n, ast.AugAssign) and _is_name(n.target, "loss") for s in tail
        for n in ast.walk(s)
    ) or any(_is_name(n, "load_balancing_loss_func") for s in tail for n in ast.walk(s))

    fn.body = [
        *body[:head_at],
        _assign(name, _call(DEFER, ast.Name(id="self", ctx=ast.Load()),
                            ast.Attribute(value=ast.Name(id="self", ctx=ast.Load()),
                                          attr=head_attr, ctx=ast.Load()), arg)),
        *recorded,
        *new_between,
        loss_stmt,
        _assign(name, _call(DONE, ast.Name(id=name, ctx=ast.Load()))),
        *tail,
    ]
    # auto_docstring only writes the docstring (and inspects the function's file): drop it.
    fn.decorator_list = [
        d for d in fn.decorator_list
        if "auto_docstring" not in ast.unparse(d.func if isinstance(d, ast.Call) else d)
    ]
    ast.fix_missing_locations(tree)
    module = sys.modules[raw.__module__]
    namespace = dict(vars(module))
    from .forward import rewrite_helpers  # late: forward imports this module

    namespace.update(rewrite_helpers())
    code = compile(tree, f"<fused_ce_patch rewrite of {raw.__module__}.{raw.__qualname__}>",
                   "exec")
    exec(code, namespace)  # noqa: S102 - the stock source, with the head statements swapped
    rewritten = namespace[fn.name]
    return ArchSpec(
        class_name=klass.__name__,
        module=klass.__module__,
        head_attr=head_attr,
        transform=tuple(f"{k} {ast.unparse(e)}" for k, e in transform),
        moe_aux=moe_aux,
        source_hash=hashlib.sha256(source.encode()).hexdigest()[:16],
        stock=stock,
        rewritten=rewritten,
    )


def derive_spec(cls: type) -> ArchSpec:
    """The :class:`ArchSpec` of causal-LM class ``cls`` (cached per defining class).

    Raises:
        UnsupportedModelError: the forward's source does not have the shape described in this
            module (the message names the statement).
    """
    from .forward import stock_forward_of

    klass = _defining_class(cls)
    return _derive(klass, stock_forward_of(klass.__dict__["forward"]))


def supported_model_types() -> list[str]:
    """``config.model_type`` values the parity sweep verified on the installed transformers."""
    from .verified import verified_types

    return verified_types()

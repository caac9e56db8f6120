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
- ``logits.float()`` (a no-op for the loss: ``ForCausalLMLoss`` upcasts anyway);
- a softcap written as a call: ``logits = self.<module>(logits)`` (Inkling2's ``Inkling2Softcap``)
  or ``logits = <function>(logits, E)`` (xLSTM's ``soft_cap``), read from the callee's live
  source at each call (:mod:`.forward`; anything else there computes the real logits);
- a statement that never names the logits, the head or the loss (GIT's
  ``shift_labels = kwargs.pop("shift_labels", None)``), run where stock runs it;
- ``if <test>: <any code> else: <transforms>`` whose test reads at most ``logits.shape``
  (xLSTM's chunked inference, Inkling's vocabulary trim): the branch the fused loss does not
  express computes the real logits first and runs as written.

It then compiles a copy of that forward in which only those statements change: the head call
defers (no logits), each transform is recorded, and the loss call goes to the fused loss
(:func:`~fused_ce_patch.hf.forward.fused_head_loss`). Everything else — decoder call, slicing,
MoE aux loss (``loss += router_aux_loss_coef * aux_loss``), multimodal inputs, output class and
fields, decorators — is the stock code, unchanged. Two other loss blocks are expressed too:
the ``loss_fct = CrossEntropyLoss(); loss = loss_fct(logits.view(-1, V), labels.view(-1))``
block of the BART family, CPM-Ant, TrOCR, Whisper and XLNet (an unshifted mean; only the call
changes, :func:`_rewrite_ce_block`), and statements after the loss call that read the logits
only as ``logits.logsumexp(dim=-1)`` (Bamba's z-loss; unchanged, :func:`_check_extra_terms`).
A class whose source does not fit raises
:class:`~fused_ce_patch.errors.UnsupportedModelError` naming the statement; a class that fits is
patched by ``apply_fused_ce`` only once the live class passes the proof on this machine
(:mod:`.proof`: the stock class and the rewrite compared on a tiny model, loss and every
gradient). The rewrite runs with the modeling module's live globals, inside copies of the stock
forward's own wrapper layers (:func:`_compile_factory`, :func:`_clone_chain`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import marshal
import sys
import textwrap
import types
from dataclasses import dataclass, field

from ..errors import NoLossToFuseError, UnsupportedModelError
from .registry import stock_forward_of, wraps_patched

# Names the rewritten forward calls: parameters of its factory, so closure variables of the
# rewrite (bound by forward.py), never names added to the modeling module.
DEFER = "__fused_ce_defer__"
TRANSFORM = "__fused_ce_transform__"
LOSS = "__fused_ce_loss__"
DONE = "__fused_ce_done__"
MATERIALIZE = "__fused_ce_materialize__"
CE = "__fused_ce_ce__"
#: The rewrite factory's parameters, in order (:func:`_compile_factory`).
HELPERS = (DEFER, TRANSFORM, LOSS, DONE, MATERIALIZE, CE)


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
        source_hash: sha256 (16 hex digits) of the raw forward's source.
        fingerprint: sha256 (16 hex digits) of that source and of every wrapper layer around
            it (:func:`_fingerprint`): what a proof of this spec covers.
        wrappers: the wrapper layers between the class attribute and the raw forward, outermost
            first (``module.qualname (file:line)``), for messages.
        stock: the stock forward (decorated, as found on the class).
        build: ``build(helpers) -> forward``: the rewritten forward inside copies of the stock
            forward's wrapper layers, with :mod:`.forward`'s helpers bound (one per patch).
        loss_form: ``"loss_function"`` (``self.loss_function(...)``: transformers' causal-LM
            loss, shifted) or ``"cross_entropy"`` (a ``CrossEntropyLoss()`` module called on
            ``logits.view(-1, V)``: unshifted mean, see :func:`_rewrite_ce_block`).
        extra_terms: the stock statements after the loss call inside the loss block (Bamba's
            z-loss), unchanged in the rewrite (:func:`_check_extra_terms`).
    """

    class_name: str
    module: str
    head_attr: str
    transform: tuple[str, ...]
    moe_aux: bool
    source_hash: str
    fingerprint: str
    wrappers: tuple[str, ...]
    stock: object = field(compare=False, repr=False)
    build: object = field(compare=False, repr=False)
    loss_form: str = "loss_function"
    extra_terms: tuple[str, ...] = ()

    @property
    def transform_name(self) -> str:
        """``none``, ``multiplier``, ``divisor``, ``softcap`` or a ``+``-joined sequence."""
        kinds = {"mul": "multiplier", "div": "divisor", "softcap": "softcap",
                 "capcall": "softcap", "capfn": "softcap"}
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


# Besides any attribute with "head" in its name: the names transformers' causal LMs give
# their head module (BERT-family `cls`, BioGPT / TrOCR `output_projection`, Whisper `proj_out`,
# XLNet `lm_loss`).
_HEAD_NAMES = ("output", "embed_out", "lm_output", "output_layer", "output_projection",
               "proj_out", "lm_loss", "cls")


def _head_expr(node):
    """``(head_attr, arg, ops)`` for ``self.<head>(arg)`` (or ``self.<proj>(self.<head>(x))``,
    ``arg`` then the inner call) followed by ``.float()`` / ``.contiguous()`` / ``* E`` /
    ``/ E`` in one expression; else None."""
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
    if not _one_arg_self_call(node):
        return None
    attr = node.func.attr
    if not _head_name(attr):
        # `self.decoder(self.lm_head(h))` (ModernBERT decoder): a head module that is only the
        # transform, then the projection; the inner call stays stock code (the hidden states
        # the fused loss takes)
        inner = node.args[0]
        if not (_one_arg_self_call(inner) and _head_name(inner.func.attr)):
            return None
    return attr, node.args[0], ops[::-1]


def _head_name(attr: str) -> bool:
    return "head" in attr or attr in _HEAD_NAMES


def _one_arg_self_call(node) -> bool:
    """``self.<attr>(x)``: one positional argument, no keywords."""
    return (isinstance(node, ast.Call) and _is_self_attr(node.func) and len(node.args) == 1
            and not node.keywords and not isinstance(node.args[0], ast.Starred))


def _head_call(stmt):
    """``(target, head_attr, arg, ops)`` for ``X = self.<head>(arg)[...]``, else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)):
        return None
    found = _head_expr(stmt.value)
    return None if found is None else (stmt.targets[0].id, *found)


def _transform_op(stmt, name):
    """One logit-transform statement on ``name`` as ``(kind, expr)``, else None.

    ``kind`` is ``mul``, ``div``, ``tanh``, ``float`` (no-op), ``capcall`` (``self.<m>(name)``)
    or ``capfn`` (``f(name, E)``, expr the tuple ``(f, E)``).
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
        if _is_self_attr(f) and len(value.args) == 1 and _is_name(value.args[0], name) \
                and not value.keywords:
            return "capcall", f  # `logits = self.logit_softcap(logits)`: checked at each call
        plain_callee = isinstance(f, ast.Name) or (isinstance(f, ast.Attribute)
                                                   and f.attr != "tanh")
        if plain_callee and len(value.args) == 2 and _is_name(value.args[0], name) \
                and not _mentions(value.args[1], name) and not value.keywords \
                and not _mentions(f, name):
            # `logits = soft_cap(logits, E)`: checked at each call
            return "capfn", ast.Tuple(elts=[f, value.args[1]], ctx=ast.Load())
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


def _one_line_softcap(stmt, name):
    """``E`` of ``name = <tanh>(name / E) * E`` (``torch.tanh`` / ``nn.functional.tanh``),
    else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and _is_name(stmt.targets[0], name)):
        return None
    value = stmt.value
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)
            and isinstance(value.left, ast.Call) and not _mentions(value.right, name)):
        return None
    call = value.left
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "tanh"
            and len(call.args) == 1 and not call.keywords):
        return None
    inner = call.args[0]
    if not (isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Div)
            and _is_name(inner.left, name) and ast.dump(inner.right) == ast.dump(value.right)):
        return None
    return value.right


def _plain_local(stmt, name, ops, before) -> bool:
    """``X = <names, attributes and constants>``: a read with no effect, not of the logits,
    whose ``X`` no earlier op uses and the code before the head never binds."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)):
        return False
    target = stmt.targets[0].id
    if target in (name, "loss") or _mentions(stmt.value, name):
        return False
    if not all(isinstance(n, (ast.Name, ast.Attribute, ast.Constant, ast.Load))
               for n in ast.walk(stmt.value)):
        return False
    if any(expr is not None and _mentions(expr, target) for _, expr in ops):
        return False
    return not any(isinstance(n, ast.Name) and n.id == target and isinstance(n.ctx, ast.Store)
                   for s in before for n in ast.walk(s))


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
        if kind in ("softcap", "capcall", "capfn"):
            if seen_softcap:
                raise UnsupportedModelError(f"{where}: two softcaps on the logits")
            seen_softcap = True
        elif seen_softcap:
            raise UnsupportedModelError(f"{where}: a logit scale after the softcap")
    return out


def _conditional_ops(stmt, name, where):
    """``(ops, guard)`` for ``if E is not None:`` (guard ``"notnone"``) or ``if E:`` (``"truthy"``)
    around transform statements whose ops all use ``E``; else None."""
    if not isinstance(stmt, ast.If) or stmt.orelse:
        return None
    test = stmt.test
    if (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None):
        guarded, guard = test.left, "notnone"
    elif isinstance(test, (ast.Attribute, ast.Name, ast.NamedExpr)):
        guarded, guard = test, "truthy"  # `if self.config.final_logit_softcapping:` (0 is off)
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
    return ops, guard


def _why_not(fn) -> str:
    """What the forward does instead, for the refusal message: a loss computed by a method
    that takes the labels (XLM's prediction layer, ProphetNet's n-gram loss), or one head per
    output stream (MusicGen's codebooks); "" when neither shows."""
    for node in ast.walk(fn):
        if isinstance(node, ast.comprehension) and _is_self_attr(node.iter) \
                and "head" in node.iter.attr:
            return (f": one head per output stream (`self.{node.iter.attr}`), which the fused "
                    f"loss (one head) does not express")
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and _is_self_attr(node.func) \
                and any(_is_name(a, "labels") for a in node.args):
            return (f": the loss is computed inside `self.{node.func.attr}(..., labels)`, which "
                    f"the rewrite does not read")
    return ""


def _ops_of(stmt, name, where):
    """The recorded ops of one transform statement (plain, one-line softcap, or under
    ``if E is not None:`` / ``if E:``, as ``"kind?guard"``), else None."""
    op = _transform_op(stmt, name)
    if op is not None:
        return [op]
    cap = _one_line_softcap(stmt, name)
    if cap is not None:  # `logits = tanh(logits / E) * E` (RecurrentGemma)
        return [("div", cap), ("tanh", None), ("mul", cap)]
    cond = _conditional_ops(stmt, name, where)
    if cond is not None:
        # "kind?guard": the op runs when the guard holds (`is not None`, or truthiness)
        return [(f"{k}?{cond[1]}", e) for k, e in cond[0]]
    return None


def _record(ops, name) -> list:
    """``name = TRANSFORM(name, kind, expr, guard)`` statements for ``ops``, in order, with
    ``div E, tanh, mul E`` folded into one softcap (conditional ops skip None/0 at run)."""
    folded, i = [], 0
    while i < len(ops):
        kind, expr = ops[i]
        base, _, guard = kind.partition("?")
        if (base == "div" and i + 2 < len(ops) and ops[i + 1][0].split("?")[0] == "tanh"
                and ops[i + 2][0].split("?")[0] == "mul"):
            folded.append(("softcap", expr, guard or False))
            i += 3
            continue
        folded.append((base, expr, guard or False))
        i += 1
    # `.float()` is recorded too: a no-op for the fused loss, replayed when a call has to
    # materialise the logits (forward.py), so they come out exactly as stock's.
    return [_assign(name, _call(
        TRANSFORM, ast.Name(id=name, ctx=ast.Load()), ast.Constant(kind),
        ast.Constant(None) if expr is None else expr, ast.Constant(optional),
    )) for kind, expr, optional in folded]


def _neutral(stmt, name, head_attr) -> bool:
    """A statement that never sees the logits, the head or the loss (no return, no ``if``):
    the rewrite runs it where stock does."""
    if isinstance(stmt, (ast.If, ast.Return, ast.FunctionDef, ast.AsyncFunctionDef,
                         ast.ClassDef)):
        return False
    for node in ast.walk(stmt):
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom, ast.Await, ast.Global,
                             ast.Nonlocal, ast.Lambda)) or _is_name(node, name) \
                or _is_name(node, "loss") or _is_self_attr(node, head_attr) \
                or _is_self_attr(node, "loss_function"):
            return False
    return True


def _materializing_if(stmt, name, head_attr, where):
    """``(else_ops, reason)`` for ``if <test>: <body> [else: <transform statements>]`` whose test
    reads the logits only through ``name.shape`` and whose body neither returns nor touches the
    loss or the head: the rewrite runs the body on the real logits (the stock code), the else
    branch as recorded ops. None for any other statement."""
    if not isinstance(stmt, ast.If):
        return None
    shape_reads = {id(n.value) for n in ast.walk(stmt.test) if isinstance(n, ast.Attribute)
                   and n.attr == "shape" and _is_name(n.value, name)}
    if any(_is_name(n, name) and id(n) not in shape_reads for n in ast.walk(stmt.test)):
        return None
    for node in ast.walk(ast.Module(body=stmt.body, type_ignores=[])):
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom, ast.Global, ast.Nonlocal)) \
                or _is_name(node, "loss") or _is_self_attr(node, head_attr) \
                or _is_self_attr(node, "loss_function"):
            return None
    else_ops = []
    for inner in stmt.orelse:
        found = _ops_of(inner, name, where)
        if found is None:
            return None
        else_ops += found
    test = ast.unparse(stmt.test)
    test = test if len(test) <= 60 else test[:57] + "..."
    return else_ops, f"its forward takes a branch the fused loss does not express (`if {test}`)"


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
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    if "labels" not in params and not _contains_loss_call(fn):
        raise NoLossToFuseError(
            f"{where} takes no labels and computes no loss: nothing to fuse (its caller "
            f"computes the loss from its logits)")
    body = fn.body
    head_at = next((i for i, s in enumerate(body) if _head_call(s)), None)
    if head_at is None:
        raise UnsupportedModelError(f"{where}: no top-level `logits = self.lm_head(hidden)`"
                                    f"{_why_not(fn)}")
    name, head_attr, arg, head_ops = _head_call(body[head_at])
    loss_at = next((i for i in range(head_at + 1, len(body)) if _contains_loss_call(body[i])),
                   None)
    ce_form = False
    if loss_at is None:
        loss_at = _ce_block_at(body, head_at, where)
        ce_form = loss_at is not None
    if loss_at is None:
        raise UnsupportedModelError(f"{where}: no `self.loss_function(...)` after the head "
                                    f"(nor a `CrossEntropyLoss()` block){_why_not(fn)}")
    if not ce_form and sum(_contains_loss_call(s) for s in body) != 1:
        raise UnsupportedModelError(f"{where}: more than one self.loss_function call")

    # The transform statements between head and loss, emitted in order: runs of recorded ops,
    # and `if` statements whose unexpressed branch computes the real logits first.
    ops, emitted, pending, locals_before = list(head_ops), [], list(head_ops), []
    for stmt in body[head_at + 1:loss_at]:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and _is_name(stmt.targets[0], "loss") and isinstance(stmt.value, ast.Constant)
                and stmt.value.value is None):
            emitted += _record(pending, name)
            pending = []
            emitted.append(stmt)
            continue
        found = _ops_of(stmt, name, where)
        if found is not None:
            ops += found
            pending += found
            continue
        if _plain_local(stmt, name, ops, body[:head_at]):
            # `cap = self.config.logits_soft_cap`: a read with no effect, run before the
            # recorded ops that use it
            locals_before.append(stmt)
            continue
        if _neutral(stmt, name, head_attr):
            # `shift_labels = kwargs.pop("shift_labels", None)` (GIT): stock code that never
            # sees the logits, run in its place
            if pending and pending[-1][0].split("?")[0] in ("div", "tanh"):
                raise UnsupportedModelError(
                    f"{where}: a statement inside the softcap: `{ast.unparse(stmt)[:60]}`")
            emitted += _record(pending, name)
            pending = []
            emitted.append(stmt)
            continue
        branch = _materializing_if(stmt, name, head_attr, where)
        if branch is not None:
            else_ops, reason = branch
            ops += else_ops
            emitted += _record(pending, name)
            pending = []
            stmt.body.insert(0, _assign(name, _call(
                MATERIALIZE, ast.Name(id=name, ctx=ast.Load()), ast.Constant(reason))))
            stmt.orelse = _record(else_ops, name)
            emitted.append(stmt)
            continue
        raise UnsupportedModelError(
            f"{where}: unknown statement between the head and the loss: "
            f"`{ast.unparse(stmt).splitlines()[0]}`"
        )
    emitted += _record(pending, name)
    plain = [(k.split("?")[0], e) for k, e in ops]
    transform = _collapse(plain, where)

    # The loss statement: `loss = self.loss_function(logits, labels, ...)`, possibly under
    # `if labels is not None:`; its first argument must be the head's output.
    loss_stmt = body[loss_at]
    if ce_form:
        # `loss_fct = CrossEntropyLoss(); loss = loss_fct(logits.view(-1, V), labels.view(-1))`
        extra = _rewrite_ce_block(loss_stmt, name, head_attr, where)
    else:
        extra = _rewrite_loss_function_block(loss_stmt, name, head_attr, where)
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
        *locals_before,
        *emitted,
        loss_stmt,
        _assign(name, _call(DONE, ast.Name(id=name, ctx=ast.Load()))),
        *tail,
    ]
    # Decorators are not re-applied: the stock forward's own wrapper objects are reused around
    # the rewrite (_clone_chain), so every wrapper that runs around the stock forward runs
    # around the fused one, whoever installed it.
    fn.decorator_list = []
    chain = _wrapper_chain(stock, where)
    ast.fix_missing_locations(tree)
    build = _compile_factory(tree, fn, raw, chain)
    return ArchSpec(
        class_name=klass.__name__,
        module=klass.__module__,
        head_attr=head_attr,
        transform=tuple(f"{k} {ast.unparse(e)}" for k, e in transform),
        moe_aux=moe_aux,
        source_hash=hashlib.sha256(source.encode()).hexdigest()[:16],
        fingerprint=_fingerprint(source, chain),
        wrappers=tuple(_layer_name(layer) for layer in chain[:-1]),
        stock=stock,
        build=build,
        loss_form="cross_entropy" if ce_form else "loss_function",
        extra_terms=tuple(ast.unparse(t).splitlines()[0] for t in extra),
    )


# -- the loss block -----------------------------------------------------------------------------


def _rewrite_loss_function_block(stmt, name, head_attr, where) -> list:
    """Rewrite ``loss = self.loss_function(logits, labels, ..., **kwargs)`` (possibly under
    ``if labels is not None:``) in place to the fused loss; returns the statements that follow
    the call inside that ``if`` (extra loss terms, kept as they are: :func:`_check_extra_terms`).
    """
    inner, extra, views = stmt, [], {name}
    if isinstance(stmt, ast.If):
        if stmt.orelse or not stmt.body:
            raise UnsupportedModelError(f"{where}: the loss block has an `else:`")
        at = next((i for i, s in enumerate(stmt.body) if _contains_loss_call(s)), 0)
        for prelude in stmt.body[:at]:
            views |= _prelude_views(prelude, name, head_attr, where)
        inner, extra = stmt.body[at], stmt.body[at + 1:]
    if not (isinstance(inner, ast.Assign) and isinstance(inner.value, ast.Call)
            and _is_self_attr(inner.value.func, "loss_function")):
        raise UnsupportedModelError(
            f"{where}: the loss is not `loss = self.loss_function(...)`: "
            f"`{ast.unparse(inner).splitlines()[0]}`"
        )
    call = inner.value
    first = call.args[0] if call.args else next(
        (k.value for k in call.keywords if k.arg == "logits"), None)
    if not (isinstance(first, ast.Name) and first.id in views):
        raise UnsupportedModelError(f"{where}: the loss is not computed from `{name}`")
    if not any(k.arg is None for k in call.keywords):
        raise UnsupportedModelError(
            f"{where}: the loss call does not pass **kwargs (num_items_in_batch, shift_labels)"
        )
    _check_extra_terms(extra, name, head_attr, where)
    call.func = ast.Name(id=LOSS, ctx=ast.Load())
    call.args.insert(0, ast.Name(id="self", ctx=ast.Load()))  # the model, for its live loss
    return extra


def _prelude_views(stmt, name, head_attr, where) -> set:
    """Check one statement before the loss call inside the loss block; return the names it
    binds to positions of the logits. Accepted (GIT): statements that never see the logits,
    ``X = name[...]`` / ``X = name[...].contiguous()`` (a :class:`DeferredLogits` of those
    positions at run time, or real logits for another index), and ``if`` blocks of both."""
    if isinstance(stmt, ast.If) and not _mentions(stmt.test, name):
        views = set()
        for inner in (*stmt.body, *stmt.orelse):
            views |= _prelude_views(inner, name, head_attr, where)
        return views
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
            and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id not in (name, "loss"):
        value = stmt.value
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                and value.func.attr == "contiguous" and not value.args and not value.keywords):
            value = value.func.value
        if isinstance(value, ast.Subscript) and _is_name(value.value, name) \
                and not _mentions(value.slice, name) \
                and not any(_is_self_attr(n, head_attr) for n in ast.walk(value.slice)):
            return {stmt.targets[0].id}
    if _neutral(stmt, name, head_attr):
        return set()
    raise UnsupportedModelError(
        f"{where}: the loss block does more than the loss call before it: "
        f"`{ast.unparse(stmt).splitlines()[0]}`")


def _is_ce_ctor(node) -> bool:
    """``CrossEntropyLoss(...)`` / ``nn.CrossEntropyLoss(...)`` (any spelling of the name)."""
    return isinstance(node, ast.Call) and (
        _is_name(node.func, "CrossEntropyLoss")
        or (isinstance(node.func, ast.Attribute) and node.func.attr == "CrossEntropyLoss"))


def _ce_block_at(body, head_at, where):
    """Index of the one top-level statement after the head that constructs a
    ``CrossEntropyLoss``, or None when there is none."""
    found = [i for i in range(head_at + 1, len(body))
             if any(_is_ce_ctor(n) for n in ast.walk(body[i]))]
    if len(found) > 1:
        raise UnsupportedModelError(f"{where}: more than one CrossEntropyLoss block")
    return found[0] if found else None


def _is_last_dim(node, name) -> bool:
    """``name.size(-1)`` or ``name.shape[-1]``."""
    minus_one = ast.dump(ast.parse("-1", mode="eval").body)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "size" and _is_name(node.func.value, name) \
            and len(node.args) == 1 and not node.keywords:
        return ast.dump(node.args[0]) == minus_one
    return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "shape" and _is_name(node.value.value, name)
            and ast.dump(node.slice) == minus_one)


def _rewrite_ce_block(stmt, name, head_attr, where) -> list:
    """Rewrite the ``CrossEntropyLoss`` form of the loss block in place; return the statements
    after the loss call (extra terms, :func:`_check_extra_terms`).

    Accepted (BART, mBART, Marian, Pegasus, PLBart, Blenderbot(-Small), BigBird-Pegasus, MVP,
    CPM-Ant, TrOCR, Whisper, XLNet on transformers 5.2x)::

        if labels is not None:
            labels = labels.to(logits.device)        # optional
            loss_fct = CrossEntropyLoss()
            loss = loss_fct(logits.view(-1, V), labels.view(-1))

    with ``V`` any expression not reading the logits, or ``logits.size(-1)`` /
    ``logits.shape[-1]``. Only the loss call changes: it becomes
    ``loss = CE(self, loss_fct, logits, V or None, labels.view(-1))``
    (:func:`~fused_ce_patch.hf.forward.fused_module_ce_loss`), which checks at run time that
    ``loss_fct`` is a plain ``torch.nn.CrossEntropyLoss`` (the module global may have been
    replaced) and otherwise runs this very call on real logits. The labels move and the
    constructor are the stock statements (``logits.device`` is the device stock's logits would
    have).
    """
    test = stmt.test if isinstance(stmt, ast.If) else None
    if not (test is not None and not stmt.orelse and isinstance(test, ast.Compare)
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.left, ast.Name)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None):
        raise UnsupportedModelError(
            f"{where}: the CrossEntropyLoss block is not `if labels is not None:` without "
            f"`else:`: `{ast.unparse(stmt).splitlines()[0]}`")
    labels = test.left.id
    fct = None
    for i, inner in enumerate(stmt.body):
        simple = isinstance(inner, ast.Assign) and len(inner.targets) == 1 \
            and isinstance(inner.targets[0], ast.Name)
        target = inner.targets[0].id if simple else None
        value = inner.value if simple else None
        if simple and target == labels and isinstance(value, ast.Call) \
                and isinstance(value.func, ast.Attribute) and value.func.attr == "to" \
                and _is_name(value.func.value, labels) and len(value.args) == 1 \
                and not value.keywords and isinstance(value.args[0], ast.Attribute) \
                and value.args[0].attr == "device" and _is_name(value.args[0].value, name):
            continue  # `labels = labels.to(logits.device)`
        if simple and target not in (name, labels) and _is_ce_ctor(value) \
                and not _mentions(value, name):
            fct = target
            continue
        if simple and fct is not None and target not in (name, labels, fct) \
                and isinstance(value, ast.Call) and _is_name(value.func, fct) \
                and len(value.args) == 2 and not value.keywords:
            view, flat = value.args
            if (isinstance(view, ast.Call) and isinstance(view.func, ast.Attribute)
                    and view.func.attr == "view" and _is_name(view.func.value, name)
                    and len(view.args) == 2 and not view.keywords
                    and ast.dump(view.args[0]) == ast.dump(ast.parse("-1", mode="eval").body)
                    and not _mentions(flat, name)):
                vocab = view.args[1]
                if _is_last_dim(vocab, name):
                    vocab = ast.Constant(None)
                elif _mentions(vocab, name):
                    vocab = None
                if vocab is not None:
                    inner.value = ast.copy_location(
                        _call(CE, ast.Name(id="self", ctx=ast.Load()),
                              ast.Name(id=fct, ctx=ast.Load()), ast.Name(id=name, ctx=ast.Load()),
                              vocab, flat), value)
                    extra = stmt.body[i + 1:]
                    _check_extra_terms(extra, name, head_attr, where)
                    return extra
        raise UnsupportedModelError(
            f"{where}: unknown statement in the CrossEntropyLoss block: "
            f"`{ast.unparse(inner).splitlines()[0]}`")
    raise UnsupportedModelError(f"{where}: the CrossEntropyLoss block has no loss call")


def _check_extra_terms(stmts, name, head_attr, where) -> None:
    """Accept statements after the loss call inside the loss block (extra loss terms) that run
    unchanged on the deferred logits: assignments to plain names other than ``name`` and
    ``if`` blocks of such statements, reading the logits only as ``name.logsumexp(dim=-1)``
    (:meth:`~fused_ce_patch.hf.forward.DeferredLogits.logsumexp`: per-position log-sum-exp
    without logits). Bamba's z-loss::

        if self.z_loss_coefficient > 0:
            z_loss = logits.logsumexp(dim=-1).to(dtype=loss.dtype).pow(2).mean()
            loss = loss + self.z_loss_coefficient * z_loss

    Raises:
        UnsupportedModelError: naming the first statement that is not of that kind.
    """
    minus_one = ast.dump(ast.parse("-1", mode="eval").body)
    for stmt in stmts:
        ok = True
        if isinstance(stmt, ast.If):
            ok = not _mentions(stmt.test, name)
            if ok:
                _check_extra_terms([*stmt.body, *stmt.orelse], name, head_attr, where)
        elif isinstance(stmt, (ast.Assign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            ok = all(isinstance(t, ast.Name) and t.id != name for t in targets)
            allowed = set()
            for n in ast.walk(stmt.value):
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                        and n.func.attr == "logsumexp" and _is_name(n.func.value, name)
                        and ((not n.args and len(n.keywords) == 1 and n.keywords[0].arg == "dim"
                              and ast.dump(n.keywords[0].value) == minus_one)
                             or (not n.keywords and len(n.args) == 1
                                 and ast.dump(n.args[0]) == minus_one))):
                    allowed.add(id(n.func.value))
            ok = ok and all(id(n) in allowed for n in ast.walk(stmt.value) if _is_name(n, name))
        else:
            ok = False
        if ok and any(_is_self_attr(n, head_attr) for n in ast.walk(stmt)):
            ok = False
        if not ok:
            raise UnsupportedModelError(
                f"{where}: the loss block does more than the loss call: "
                f"`{ast.unparse(stmt).splitlines()[0]}`")


def _layer_name(fn) -> str:
    code = getattr(fn, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}" \
        f"{where}"


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _EMPTY


_EMPTY = object()


def _wrapper_chain(stock, where) -> list:
    """``[stock, ..., raw]``: the forward as found on the class, down its ``__wrapped__`` links.

    Every layer above the raw function must be a plain function holding the next layer in
    exactly one closure cell (``functools.wraps`` decorators: transformers' ``can_return_tuple``
    and ``deprecate_kwarg``, a user's logging or label-fixing wrapper): the rewrite is run
    inside copies of those very layers. Anything else is refused, since it would run around
    the stock forward and not around the fused one.
    """
    if wraps_patched(stock):
        raise UnsupportedModelError(
            f"{where} wraps a forward patched by fused_ce_patch; revert_fused_ce(cls) before "
            f"wrapping it, or patch the wrapped class again after reverting"
        )
    chain = [stock]
    while hasattr(chain[-1], "__wrapped__"):
        layer, inner = chain[-1], chain[-1].__wrapped__
        cells = [c for c in (getattr(layer, "__closure__", None) or ())
                 if _cell_value(c) is inner]
        if not isinstance(layer, types.FunctionType) or len(cells) != 1:
            raise UnsupportedModelError(
                f"{where} is wrapped by {_layer_name(layer)}, which does not hold the function "
                f"it wraps in its closure; fused_ce_patch cannot run that wrapper around the "
                f"fused forward (apply fused_ce_patch before wrapping, or wrap with a closure)"
            )
        chain.append(inner)
        if len(chain) > 32:
            raise UnsupportedModelError(f"{where}: more than 32 wrapper layers")
    return chain


def _fingerprint(source: str, chain) -> str:
    """sha256 (16 hex digits) of the forward's source and of every wrapper layer around it:
    its source (or code object) and the simple values it closes over (decorator arguments)."""
    digest = hashlib.sha256(source.encode())
    for layer in chain[:-1]:
        try:
            text = inspect.getsource(layer)
        except (OSError, TypeError):
            text = repr(marshal.dumps(layer.__code__))
        digest.update(f"\0{layer.__module__}.{layer.__qualname__}\0{text}".encode())
        for cell in layer.__closure__ or ():
            value = _cell_value(cell)
            simple = value is None or isinstance(value, (str, int, float, bool, tuple))
            digest.update((repr(value) if simple else type(value).__qualname__).encode())
    return digest.hexdigest()[:16]


def _compile_factory(tree, fn, raw, chain):
    """``build(helpers) -> forward``: the rewritten function inside copies of the stock wrappers.

    The rewritten ``def`` is compiled inside a factory whose parameters are the helper names
    (:data:`HELPERS`), so the helpers are closure variables and the function's globals are
    the modeling module's own ``__dict__``: a module global replaced after the patch (a fixed
    ``load_balancing_loss_func``, a patched helper) is seen by the fused forward exactly as
    by the stock one. Nothing is added to the module.
    """
    template = ast.parse(f"def __fused_ce_factory__({', '.join(HELPERS)}):\n    pass\n")
    factory = template.body[0]
    factory.body = [fn, ast.Return(value=ast.Name(id=fn.name, ctx=ast.Load()))]
    ast.fix_missing_locations(template)
    module = sys.modules[raw.__module__]
    code = compile(template, f"<fused_ce_patch rewrite of {raw.__module__}.{raw.__qualname__}>",
                   "exec")
    factory_code = next(c for c in code.co_consts
                        if isinstance(c, types.CodeType) and c.co_name == factory.name)
    make = types.FunctionType(factory_code, module.__dict__)

    def build(helpers: dict):
        inner = make(*(helpers[k] for k in HELPERS))
        inner.__qualname__, inner.__module__, inner.__doc__ = (
            raw.__qualname__, raw.__module__, raw.__doc__)
        inner.__dict__.update({k: v for k, v in raw.__dict__.items() if k != "__wrapped__"})
        return _clone_chain(chain, inner)

    return build


def _clone_chain(chain, inner):
    """Copies of ``chain``'s wrapper layers, innermost first, each closing over the copy below
    it instead of the stock function; ``inner`` replaces the raw stock function."""
    for layer, wrapped in zip(reversed(chain[:-1]), reversed(chain[1:])):
        closure = tuple(
            types.CellType(inner) if _cell_value(c) is wrapped else c for c in layer.__closure__
        )
        clone = types.FunctionType(layer.__code__, layer.__globals__, layer.__name__,
                                   layer.__defaults__, closure)
        clone.__kwdefaults__ = layer.__kwdefaults__
        clone.__dict__.update(layer.__dict__)
        clone.__wrapped__ = inner
        clone.__qualname__, clone.__module__, clone.__doc__ = (
            layer.__qualname__, layer.__module__, layer.__doc__)
        clone.__annotations__ = dict(getattr(layer, "__annotations__", {}) or {})
        inner = clone
    return inner


def derive_spec(cls: type) -> ArchSpec:
    """The :class:`ArchSpec` of causal-LM class ``cls`` (cached per defining class).

    Raises:
        UnsupportedModelError: the forward's source does not have the shape described in this
            module (the message names the statement).
    """
    klass = _defining_class(cls)
    return _derive(klass, stock_forward_of(klass.__dict__["forward"]))


def supported_model_types() -> list[str]:
    """``config.model_type`` values the sweep's record (docs/support.json) lists as passing on
    the installed transformers release — documentation, not the gate (:mod:`.proof` is)."""
    from .verified import verified_types

    return verified_types()

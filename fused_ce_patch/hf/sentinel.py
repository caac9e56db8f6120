"""The guarded placeholder that stands in ``outputs.logits`` on the fused loss path.

The fused path never builds the ``[batch, seq, vocab]`` logits, so the output carries a
:class:`NotMaterializedLogits` object instead. It is deliberately not a tensor and not None:

- not None, so ``ModelOutput.to_tuple()`` keeps the stock tuple positions
  (``(loss, logits, cache, ...)``) for ``return_dict=False``;
- not a tensor, so accelerate's ``convert_outputs_to_fp32`` and ``ModelOutput`` pass it
  through untouched;
- any use as a tensor (attribute access, indexing, arithmetic, comparison, ``len``, ``bool``,
  torch functions through ``__torch_function__``, numpy through ``__array__``) raises
  :class:`~fused_ce_patch.errors.LogitsNotMaterializedError` explaining how to get real logits.

``repr()``/``str()``, ``is None``, ``isinstance``, ``copy``/``deepcopy`` and pickling work.
Attribute probes (``hasattr(x, "dtype")``, ``getattr(x, name, default)``) answer "absent"
because the attribute error is also an :class:`AttributeError`; reading the attribute itself
still raises with the explanation.
"""

from __future__ import annotations

from ..errors import LogitsNotMaterializedError

#: Environment variable that makes every patched model return real logits (training included).
RETURN_LOGITS_ENV = "FUSED_CE_RETURN_LOGITS"


def not_materialized_message(shape=None, use: str | None = None) -> str:
    """The explanation carried by every :class:`LogitsNotMaterializedError` raised here."""
    what = f"`{use}` on " if use else ""
    dims = f" (they would have had shape {list(shape)})" if shape is not None else ""
    return (
        f"{what}outputs.logits: fused_ce_patch computed this training loss straight from the "
        f"hidden states and never materialised the logits{dims}. To get real logits, call "
        f"model.eval() (evaluation and generate() always return them), apply the patch with "
        f"apply_fused_ce(model, return_logits=True), or set the environment variable "
        f"{RETURN_LOGITS_ENV}=1 (both of the last two give up the memory saving)."
    )


class LogitsAttributeError(LogitsNotMaterializedError, AttributeError):
    """Attribute access on :class:`NotMaterializedLogits`.

    Both a :class:`LogitsNotMaterializedError` (what users catch) and an
    :class:`AttributeError` (so ``hasattr``/``getattr(..., default)`` probes by accelerate,
    ``copy`` and ``pickle`` see "no such attribute" instead of crashing).
    """


class LogitsTypeError(LogitsNotMaterializedError, TypeError):
    """``iter()``/``len()`` on :class:`NotMaterializedLogits`.

    Also a :class:`TypeError`, so generic "is this iterable / sized?" probes treat the
    placeholder as a plain object.
    """


class NotMaterializedLogits:
    """Placeholder for logits the fused loss never built; raises on any tensor use.

    Args:
        shape: the ``[batch, seq, vocab]`` shape the logits would have had, shown in the
            error message only (never returned as ``.shape``).

    Raises:
        LogitsNotMaterializedError: on attribute access, indexing, iteration, ``len``,
            ``bool``, arithmetic, comparison with anything but another placeholder or None,
            torch functions and ``numpy.asarray``.
    """

    __slots__ = ("_shape", "__weakref__")

    def __init__(self, shape=None):
        object.__setattr__(self, "_shape", None if shape is None else tuple(int(s) for s in shape))

    def _raise(self, use: str):
        raise LogitsNotMaterializedError(
            not_materialized_message(object.__getattribute__(self, "_shape"), use)
        )

    # Attribute access: everything not defined on the class is refused.
    def __getattr__(self, name: str):
        raise LogitsAttributeError(
            not_materialized_message(object.__getattribute__(self, "_shape"), f".{name}")
        )

    def __setattr__(self, name, value):
        self._raise(f".{name} = ...")

    def __delattr__(self, name):
        self._raise(f"del .{name}")

    # What must keep working.
    def __repr__(self) -> str:
        shape = object.__getattribute__(self, "_shape")
        dims = f", would-be shape {list(shape)}" if shape is not None else ""
        return (
            f"NotMaterializedLogits(fused_ce_patch skipped the logits{dims}; "
            f"model.eval(), return_logits=True or {RETURN_LOGITS_ENV}=1 gives real ones)"
        )

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        if spec:  # a numeric format such as f"{logits:.3f}" is a use as a tensor
            self._raise(f"format(..., {spec!r})")
        return repr(self)

    def __reduce__(self):
        return (type(self), (object.__getattribute__(self, "_shape"),))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __eq__(self, other):
        if other is None or isinstance(other, NotMaterializedLogits):
            return isinstance(other, NotMaterializedLogits)
        self._raise("==")

    def __ne__(self, other):
        if other is None or isinstance(other, NotMaterializedLogits):
            return not isinstance(other, NotMaterializedLogits)
        self._raise("!=")

    __hash__ = object.__hash__

    # Tensor protocols.
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        raise LogitsNotMaterializedError(not_materialized_message(None, f"torch.{name}(...)"))

    def __array__(self, *args, **kwargs):
        self._raise("numpy.asarray")

    def __getitem__(self, key):
        self._raise("[...]")

    def __setitem__(self, key, value):
        self._raise("[...] = ...")

    def __iter__(self):
        raise LogitsTypeError(
            not_materialized_message(object.__getattribute__(self, "_shape"), "iter()")
        )

    def __len__(self):
        raise LogitsTypeError(
            not_materialized_message(object.__getattribute__(self, "_shape"), "len()")
        )

    def __bool__(self):
        self._raise("bool()")

    def __contains__(self, item):
        self._raise("in")

    def __float__(self):
        self._raise("float()")

    def __int__(self):
        self._raise("int()")

    def __index__(self):
        self._raise("index")

    def __complex__(self):
        self._raise("complex()")


def _install_operators():
    """Binary, reflected, in-place and unary operators all raise with the explanation."""
    binary = ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "divmod", "pow",
              "lshift", "rshift", "and", "xor", "or")
    compare = ("lt", "le", "gt", "ge")
    unary = ("neg", "pos", "abs", "invert", "round", "trunc", "floor", "ceil")

    def make(dunder):
        def op(self, *args):
            self._raise(dunder)

        op.__name__ = dunder
        return op

    names = [f"__{n}__" for n in binary] + [f"__r{n}__" for n in binary]
    names += [f"__i{n}__" for n in binary if n != "divmod"]
    names += [f"__{n}__" for n in compare + unary]
    for dunder in names:
        setattr(NotMaterializedLogits, dunder, make(dunder))


_install_operators()

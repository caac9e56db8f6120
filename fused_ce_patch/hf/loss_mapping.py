"""Patched models' logits loss: transformers' causal-LM loss without the float32 logits copy.

When a model does materialise its logits (evaluation, ``return_logits=True``, a custom head),
transformers computes the loss with ``ForCausalLMLoss``, whose first line is
``logits = logits.float()``: a full ``[tokens, vocab]`` float32 copy (plus its gradient) on top
of the logits. :func:`chunked_causal_lm_loss` computes the same value and gradient over row
chunks: forward keeps one float32 log-sum-exp per row; backward recomputes the softmax chunk by
chunk and writes the gradient in the logits' dtype.

Routing: the chunked loss reaches only patched models, never through ``LOSS_MAPPING``.
``apply_fused_ce`` gives the instance its own ``loss_function`` (:func:`install_instance_loss`,
transformers' setter, i.e. ``model._loss_function``, which ``PreTrainedModel.loss_function``
returns before looking in ``LOSS_MAPPING`` on 5.17 and 5.24); a class patch
(``apply_fused_ce_to_<arch>()``) puts a ``loss_function`` property on that class only
(:func:`route_class`). ``LOSS_MAPPING`` and the ``ForCausalLMLoss`` names stay transformers'
own objects, so a never-patched model, before, during or after a patch, computes exactly the
stock loss; and the chunked loss itself gives stock's results and exception types (NaN for an
all-ignored mean, ``IndexError`` for a label outside ``[0, V)``).

The Trainer identity test stays true for the same reason: ``Trainer.__init__`` decides how it
counts ``num_items_in_batch`` with ``LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss``
(``transformers/trainer.py``, ``_loss_shifts_labels``); it looks at the mapping and the class's
``loss_type``, not at ``model.loss_function``, and both are untouched, so it counts
``labels[..., 1:]`` as it does for the stock model (and the chunked loss shifts exactly as
``ForCausalLMLoss`` does).

The one exception is the explicit, process-wide opt-in :func:`apply_fused_ce_to_loss_mapping`:
it re-registers every ``LOSS_MAPPING`` alias of ``ForCausalLMLoss`` (and the name itself, so
Trainer's identity test still holds) with this module's :func:`ForCausalLMLoss`,
observationally identical to transformers', until ``revert_fused_ce()``.
"""

from __future__ import annotations

import sys
import threading
import weakref

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad as _forward_ad

from .. import errors as _errors
from ..errors import LabelOutOfRangeError, raise_if_double_backward

#: Bytes of float32 logits one chunk may hold in :func:`chunked_causal_lm_loss`.
CHUNK_BYTES = 64 * 2**20


class _LogitsCrossEntropy(torch.autograd.Function):
    """Sum over rows of ``CE(logits[r], labels[r])``, chunked over rows.

    forward(logits [N, V] any float dtype, labels [N] int64 with -1 at ignored rows,
    chunk_rows int) -> 0-d float32. Like ``ForCausalLMLoss`` (``logits.float()``), the
    arithmetic is float32 whatever the logits' dtype. The caller divides (by the count or by
    ``num_items_in_batch``) with autograd, as ``F.cross_entropy`` / ``fixed_cross_entropy`` do.
    """

    @staticmethod
    def forward(ctx, logits, labels, chunk_rows):
        acc = torch.float32
        n = logits.shape[0]
        lse = torch.empty(n, dtype=acc, device=logits.device)
        total = torch.zeros((), dtype=acc, device=logits.device)
        valid = labels >= 0
        for r0 in range(0, n, chunk_rows):
            r1 = min(r0 + chunk_rows, n)
            z = logits[r0:r1].to(acc)
            lse_c = torch.logsumexp(z, dim=-1)
            # F.cross_entropy's log_softmax turns a row holding +inf into NaN (inf - inf);
            # logsumexp alone would give inf
            lse_c = torch.where(lse_c == float("inf"), float("nan"), lse_c)
            lse[r0:r1] = lse_c
            zy = z.gather(1, labels[r0:r1].clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(valid[r0:r1], lse_c - zy, 0.0).sum()
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_rows = chunk_rows
        return total

    @staticmethod
    def backward(ctx, grad_out):
        raise_if_double_backward(
            "the chunked LOSS_MAPPING causal-LM loss",
            "call revert_fused_ce(model) (or revert_fused_ce() for the process-wide opt-in) "
            "for the steps that need them")
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        valid = labels >= 0
        s = grad_out.to(lse.dtype)
        n = logits.shape[0]
        for r0 in range(0, n, ctx.chunk_rows):
            r1 = min(r0 + ctx.chunk_rows, n)
            # A new tensor: for float32 logits `.to()` would alias them and the in-place
            # ops below would overwrite the caller's logits.
            p = (logits[r0:r1].to(lse.dtype) - lse[r0:r1].unsqueeze(1)).exp_()
            y = labels[r0:r1].clamp(min=0).unsqueeze(1)
            # log-softmax's backward as torch forms it: p * s everywhere, then -s at the
            # target (so an infinite s gives NaN there, as stock does, not s * (p - 1)).
            p.mul_(s).scatter_add_(1, y, (-s).expand(y.shape).contiguous())
            # ignored rows get an exact 0 even when s is inf or NaN (nll_loss skips them)
            grad[r0:r1] = torch.where(valid[r0:r1].unsqueeze(1), p, 0.0)
        return grad, None, None


def chunked_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` computed in row chunks, without a float32 logits copy.

    Observationally identical to ``transformers.loss.loss_utils.ForCausalLMLoss``: labels are
    shifted left by one (the last position predicts nothing) unless ``shift_labels`` is given,
    ignored positions add nothing, and the result is the mean over counted positions (NaN
    when none is counted, as ``F.cross_entropy``; Trainer's evaluation drops such batches)
    or, when ``num_items_in_batch`` is given, ``sum / num_items_in_batch`` evaluated by the
    very expression transformers uses (so every value, dtype and shape of it behaves as
    stock: 0 gives inf, NaN gives NaN, a ``[1]`` tensor a ``[1]`` loss, a float64 tensor a
    float64 loss). Gradients are autograd's of that division over the chunked sum, whose
    backward forms the log-softmax gradient as torch does.

    Inputs the chunked path does not take (logits that are not a floating tensor or whose
    ``[-1, V]`` view fails, labels that are not int64, a non-int ``ignore_index`` or
    ``vocab_size``, neither labels nor shift_labels), calls traced by ``torch.compile`` and
    calls during a CUDA graph capture go to ``ForCausalLMLoss`` itself, so its exceptions and
    results are stock's.

    Args:
        logits: ``[..., V]`` logits in any float dtype (kept in it; chunks are upcast).
        labels: ``[...]`` int64 labels (unshifted), or None when ``shift_labels`` is given.
        vocab_size: ``V``.
        num_items_in_batch: the divisor for exact gradient accumulation, or None (mean).
        ignore_index: label value of positions that count for nothing.
        shift_labels: ``[...]`` labels already shifted by the caller (never shifted again).
        **kwargs: ignored, as in ``ForCausalLMLoss``.

    Returns:
        float32 loss (float32 arithmetic for every logits dtype, as ``ForCausalLMLoss``); 0-d
        unless ``num_items_in_batch``'s shape or dtype makes stock's division give another.

    Raises:
        IndexError: a label outside ``[0, V)`` that is not ``ignore_index`` (the type
            ``F.cross_entropy`` raises on CPU; this message names the value and V, on every
            device).
        ValueError: labels and logits hold different numbers of positions (as stock).
    """
    target = labels if shift_labels is None else shift_labels
    # Under Dynamo, stock's own loss: the label check's host read below would break the graph
    # (Inductor fuses stock's cross-entropy anyway); during a CUDA graph capture CUDA refuses it.
    if not _chunkable(logits, target, vocab_size, ignore_index) or functorch_active() \
            or torch.compiler.is_compiling() or _errors.cuda_graph_capturing(logits.device) \
            or forward_ad_dual(logits):
        return _stock_loss()(
            logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
        )
    try:  # stock views (after logits.float(), which keeps a dense tensor's strides)
        flat = logits.view(-1, vocab_size)
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
        target = shift_labels.view(-1).to(flat.device)
    except RuntimeError:
        return _stock_loss()(
            logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
        )
    if target.shape[0] != flat.shape[0]:
        raise ValueError(
            f"Expected input batch_size ({flat.shape[0]}) to match target batch_size "
            f"({target.shape[0]}): logits {tuple(logits.shape)}, labels "
            f"{tuple(shift_labels.shape)}"
        )
    counted = target != ignore_index
    count = counted.sum()
    if target.numel():
        lo, hi, n_valid = torch.stack(
            [*torch.aminmax(torch.where(counted, target, 0)), count]).tolist()
        if n_valid and (lo < 0 or hi >= vocab_size):
            bad = lo if lo < 0 else hi
            raise LabelOutOfRangeError(
                f"label {bad} is outside [0, V) with V = {vocab_size} and is not "
                f"ignore_index = {ignore_index}"
            )
    target = torch.where(counted, target, -1)
    chunk_rows = max(1, CHUNK_BYTES // (4 * max(vocab_size, 1)))
    total = _LogitsCrossEntropy.apply(flat, target, chunk_rows)
    if num_items_in_batch is None:
        return total / count  # F.cross_entropy's mean: NaN when nothing is counted
    # transformers' fixed_cross_entropy, verbatim in effect
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _chunkable(logits, target, vocab_size, ignore_index) -> bool:
    """Whether the chunked path takes this call (else ``ForCausalLMLoss`` does)."""
    return (
        isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.dim() >= 1
        and isinstance(target, torch.Tensor) and target.dtype == torch.int64
        and type(ignore_index) is int and type(vocab_size) is int and vocab_size > 0
    )


# -- routing: which models use the chunked loss -------------------------------------------


_LOSS_UTILS: list = []


def _loss_utils():
    """transformers' ``loss/loss_utils.py`` module, imported once: an import statement in the
    per-call path is a graph break under torch 2.11's Dynamo (``transformers`` is a lazy module
    subclass, "Bad import result"; seen on the H200 in a compiled step)."""
    if not _LOSS_UTILS:
        import transformers.loss.loss_utils as loss_utils

        _LOSS_UTILS.append(loss_utils)
    return _LOSS_UTILS[0]


def original_causal_lm_loss():
    """transformers' own ``ForCausalLMLoss`` (fused_ce_patch never replaces it)."""
    return _loss_utils().ForCausalLMLoss


_PROVEN: list = []


def proven_causal_lm_loss():
    """The ``ForCausalLMLoss`` the fused loss stands for: transformers' own function, as its
    ``loss/loss_utils.py`` defines it (found in ``LOSS_MAPPING`` or under its name; whatever
    has replaced it there is not it). Any other function in force is what a stock model calls,
    and patched models step aside to it (:func:`fused_loss_refusal`). Before transformers' own
    function can be found (every name replaced), an object nothing is identical to."""
    if not _PROVEN:
        loss_utils = _loss_utils()
        candidates = (loss_utils.LOSS_MAPPING.get("ForCausalLM"), loss_utils.ForCausalLMLoss,
                      *loss_utils.LOSS_MAPPING.values())
        found = next((fn for fn in candidates
                      if defined_in(fn, loss_utils.__name__, "ForCausalLMLoss")), None)
        if found is None:
            return _NOT_FOUND
        _PROVEN.append(found)
    return _PROVEN[0]


_NOT_FOUND = object()


def _stock_loss():
    """transformers' causal-LM loss itself, for inputs the chunked path leaves to it (never the
    name :func:`apply_fused_ce_to_loss_mapping` re-registered, which would call us back)."""
    return proven_causal_lm_loss()


def functorch_active() -> bool:
    """Whether a functorch transform (``torch.func.grad``, ``vmap``, ...) is running: the
    package's ``autograd.Function``s do not support them, so the stock computation runs."""
    if torch.compiler.is_compiling():  # Dynamo's own tracing shows an interpreter here
        return False
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def forward_ad_open() -> bool:
    """Whether a forward-mode AD level is open (else no tensor is dual: callers skip reading
    the operands :func:`forward_ad_dual` would test). ``forward_ad`` is imported once, at the
    top: an import statement per call costs a microsecond."""
    return getattr(_forward_ad, "_current_level", -1) >= 0


def forward_ad_dual(*tensors) -> bool:
    """Whether a forward-mode AD level is open (``torch.autograd.forward_ad.dual_level``) and
    one of ``tensors`` carries a tangent there: the package's ``autograd.Function``s have no
    ``jvp``, so the stock computation runs."""
    if not forward_ad_open():  # no level open: nothing is dual
        return False
    return any(isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None
               for t in tensors)


def defined_in(fn, module_name: str, qualname: str) -> bool:
    """``fn`` is the function ``module_name.qualname`` as that module's source defines it (not
    a replacement, not a ``functools.wraps`` wrapper defined elsewhere)."""
    module = sys.modules.get(module_name)
    code = getattr(fn, "__code__", None)
    return (module is not None and code is not None
            and getattr(fn, "__qualname__", None) == qualname
            and code.co_filename == getattr(module, "__file__", None))


_ORIGINALS: dict = {}


def capture_originals() -> None:
    """Record transformers' ``fixed_cross_entropy`` and torch's ``F.cross_entropy`` as found, if
    they are the originals (by origin, :func:`defined_in`), and the proven ``ForCausalLMLoss``.

    Called eagerly when a patch is applied: reading a function's code object is not something
    ``torch.compile`` traces, so the per-call check (:func:`stock_cross_entropy_refusal`) is by
    identity against what was recorded here. A function already replaced then is recorded as
    not found, and every call takes the stock computation."""
    if _ORIGINALS:
        return
    loss_utils = _loss_utils()
    proven_causal_lm_loss()
    fixed = loss_utils.fixed_cross_entropy
    _ORIGINALS["fixed_cross_entropy"] = (
        fixed if defined_in(fixed, loss_utils.__name__, "fixed_cross_entropy") else _NOT_FOUND)
    _ORIGINALS["cross_entropy"] = (
        F.cross_entropy if defined_in(F.cross_entropy, F.__name__, "cross_entropy")
        else _NOT_FOUND)


def stock_cross_entropy_refusal() -> str | None:
    """Why transformers' causal-LM loss would not compute what the fused loss does now (a
    replaced ``ForCausalLMLoss``, ``fixed_cross_entropy`` or ``F.cross_entropy`` — Liger's
    ``cross_entropy=True`` replaces the last), or None."""
    capture_originals()
    loss_utils = _loss_utils()
    if proven_causal_lm_loss() is _NOT_FOUND:
        return "transformers' ForCausalLMLoss was replaced"
    if loss_utils.fixed_cross_entropy is not _ORIGINALS["fixed_cross_entropy"]:
        return "transformers' fixed_cross_entropy (what ForCausalLMLoss calls) was replaced"
    if F.cross_entropy is not _ORIGINALS["cross_entropy"]:
        return "torch.nn.functional.cross_entropy was replaced"
    return None


def mapping_loss(loss_type):
    """What ``PreTrainedModel.loss_function`` returns for a model without a loss of its own:
    ``LOSS_MAPPING[loss_type]``, or the ``"ForCausalLM"`` entry for an unknown type
    (transformers 5.17-5.24 ``modeling_utils.py``)."""
    mapping = _loss_utils().LOSS_MAPPING
    if loss_type is None or loss_type not in mapping:
        loss_type = "ForCausalLM"
    return mapping[loss_type]


class InstanceLoss:
    """:func:`chunked_causal_lm_loss` as one patched model's own ``loss_function``.

    Installed by ``apply_fused_ce`` through transformers' ``loss_function`` setter (the
    instance's ``_loss_function``, read before ``LOSS_MAPPING`` by
    ``PreTrainedModel.loss_function`` on 5.17 and 5.24), so no other model sees it. At each
    call it checks what the unpatched model would call now (:meth:`stock_loss`: its own loss
    from before the patch, else ``LOSS_MAPPING[loss_type]``); when that is no longer the proven
    ``ForCausalLMLoss`` it calls that function instead. Copies share it; pickling stores the
    loss the model had before the patch, or transformers' ``ForCausalLMLoss`` when it had none
    of its own (the unpickled model is unpatched, see ``_InstanceState.__reduce__``).
    """

    __slots__ = ("previous", "loss_type", "owner")

    def __init__(self, previous, loss_type=None, owner=None):
        self.previous = previous  # the instance's own loss before the patch, or None (class's)
        self.loss_type = loss_type  # at install; the owner's own, read live, wins
        self.owner = weakref.ref(owner) if owner is not None else None

    def stock_loss(self):
        """The loss function the model would call without the patch, now (its ``loss_type``
        read at this call)."""
        if self.previous is not None:
            return self.previous
        owner = self.owner() if self.owner is not None else None
        return mapping_loss(getattr(owner, "loss_type", self.loss_type))

    def __call__(self, *args, **kwargs):
        stock = self.stock_loss()
        if is_causal_lm_loss(stock) and stock_cross_entropy_refusal() is None \
                and not functorch_active():
            return chunked_causal_lm_loss(*args, **kwargs)
        if stock is ForCausalLMLoss or stock is chunked_causal_lm_loss:
            stock = _stock_loss()  # what they stand for, as transformers computes it now
        return stock(*args, **kwargs)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        # The copy's loss_type is the copied model's: the model is in memo before its __dict__
        # is copied (copy._reconstruct).
        owner = self.owner() if self.owner is not None else None
        clone = memo.get(id(owner)) if owner is not None else None
        return InstanceLoss(self.previous, self.loss_type, clone)

    def __reduce__(self):
        if self.previous is None:
            return (original_causal_lm_loss, ())
        return (_same, (self.previous,))

    def __repr__(self):
        return "<fused_ce_patch chunked causal-LM loss>"


def _same(value):
    return value


def is_causal_lm_loss(fn) -> bool:
    """True for the proven ``ForCausalLMLoss`` and the chunked loss (the fused loss computes
    both); for an :class:`InstanceLoss`, by the loss it stands in for now."""
    if isinstance(fn, InstanceLoss):
        fn = fn.stock_loss()
    return (fn is chunked_causal_lm_loss or fn is proven_causal_lm_loss()
            or fn is ForCausalLMLoss)


def _describe(fn) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or '?'}.{name}"


def fused_loss_refusal(model) -> str | None:
    """Why ``model``'s loss in force is not the one the fused loss computes, or None.

    The loss in force is what the unpatched model would call: its own ``loss_function`` (or,
    for the loss a patch installed, what that stands in for).
    """
    fn = model.loss_function
    if is_causal_lm_loss(fn):
        return stock_cross_entropy_refusal()
    stock = fn.stock_loss() if isinstance(fn, InstanceLoss) else fn
    return (f"its loss function in force is {_describe(stock)}, not transformers' "
            f"ForCausalLMLoss that the fused loss computes")


def install_instance_loss(model):
    """Give ``model`` the chunked loss as its own ``loss_function``; returns what to revert.

    Only when its current loss is the causal-LM loss (a custom loss is left alone). Returns the
    installed :class:`InstanceLoss`, or None when nothing was installed.
    """
    if not is_causal_lm_loss(model.loss_function):
        return None
    current = model.__dict__.get("_loss_function")
    if isinstance(current, InstanceLoss):
        return current
    installed = InstanceLoss(current, getattr(model, "loss_type", None), model)
    model.__dict__["_loss_function"] = installed
    return installed


def remove_instance_loss(model, installed) -> None:
    """Undo :func:`install_instance_loss` unless the user set another loss since."""
    if installed is None or model.__dict__.get("_loss_function") is not installed:
        return
    if installed.previous is None:
        del model.__dict__["_loss_function"]
    else:
        model.__dict__["_loss_function"] = installed.previous


_CLASS_LOCK = threading.Lock()
_routed_classes: dict = {}  # class -> what its __dict__ held under "loss_function" (or None)


def route_class(cls) -> None:
    """Make instances of the class-patched ``cls`` use the chunked loss by default.

    Puts a ``loss_function`` property on ``cls`` itself that returns the chunked loss where the
    inherited property would return ``ForCausalLMLoss`` and the instance has no loss of its own
    (set through the setter); everything else, and every other class, is untouched.
    Idempotent; :func:`unroute_class` restores the class exactly.
    """
    with _CLASS_LOCK:
        if cls in _routed_classes:
            return
        inherited = next(k.__dict__["loss_function"] for k in cls.__mro__
                         if "loss_function" in k.__dict__)

        def loss_function(self):
            fn = inherited.__get__(self, type(self))
            if "_loss_function" not in self.__dict__ and is_causal_lm_loss(fn):
                return chunked_causal_lm_loss
            return fn

        def set_loss_function(self, value):
            inherited.__set__(self, value)

        _routed_classes[cls] = cls.__dict__.get("loss_function")
        cls.loss_function = property(loss_function, set_loss_function,
                                     doc=getattr(inherited, "__doc__", None))


def unroute_class(cls) -> None:
    """Undo :func:`route_class`. Idempotent."""
    with _CLASS_LOCK:
        if cls not in _routed_classes:
            return
        own = _routed_classes.pop(cls)
        if own is None:
            del cls.loss_function
        else:
            cls.loss_function = own


# -- the process-wide opt-in: LOSS_MAPPING itself ------------------------------------------

_MAPPING_LOCK = threading.Lock()
#: While the opt-in is active: [(namespace dict, key, original object)], in the order replaced.
_MAPPING_SAVED: list = []


def ForCausalLMLoss(  # noqa: N802 - named like the function it stands for
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
    **kwargs,
):
    """transformers' ``ForCausalLMLoss`` as :func:`chunked_causal_lm_loss` computes it.

    What :func:`apply_fused_ce_to_loss_mapping` puts in ``LOSS_MAPPING`` and in place of the
    ``ForCausalLMLoss`` names. Named like the function it stands for, so that code printing or
    comparing names sees the familiar one. Same arguments, result, NaN for an all-ignored
    mean and exception types as transformers' (tested against it), without the float32
    ``[tokens, vocab]`` copy of the logits.
    """
    return chunked_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                  ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)


def apply_fused_ce_to_loss_mapping() -> None:
    """Process-wide opt-in: every model on transformers' standard loss path gets the chunked loss.

    Replaces every ``LOSS_MAPPING`` entry that is transformers' ``ForCausalLMLoss``
    (``"ForCausalLM"``, ``"ForConditionalGeneration"``, ``"CsmForConditionalGeneration"``, ...)
    and the ``ForCausalLMLoss`` names in ``transformers.loss.loss_utils`` and in every imported
    ``transformers`` module that holds it (``transformers.trainer``: its
    ``LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss`` test, which decides how Trainer
    counts ``num_items_in_batch``, stays true) with :func:`ForCausalLMLoss` of this module.

    Use it for models the forward patch refuses (``apply_fused_ce`` raises), ``trust_remote_code``
    models, and code that calls ``self.loss_function`` on materialised logits: they keep their
    logits, but the loss no longer makes its float32 copy (and its gradient). It does not
    remove the logits themselves; ``apply_fused_ce`` does. Unlike everything else in
    fused_ce_patch this changes every model in the process, until :func:`revert_fused_ce` (no
    argument) restores every entry and name it replaced, by identity. Idempotent.

    All or nothing: if anything fails part-way, every entry already replaced is put back and
    :class:`RuntimeError` (chained to the cause) says nothing was changed.

    Source: Unsloth's ``patch_loss_functions`` for the idea of re-registering every alias.

    Raises:
        RuntimeError: the replacement failed part-way (rolled back; the cause is chained).
    """
    with _MAPPING_LOCK:
        if _MAPPING_SAVED:
            return
        loss_utils = _loss_utils()
        original = loss_utils.ForCausalLMLoss
        proven_causal_lm_loss()  # fix what the fused loss stands for before replacing names
        try:
            for key, fn in list(loss_utils.LOSS_MAPPING.items()):
                if fn is original:
                    _replace(loss_utils.LOSS_MAPPING, key, original)
            for name, module in list(sys.modules.items()):
                # The module's own namespace, not getattr: a lazy module (transformers'
                # _LazyModule) would import a submodule to answer, which may fail (a missing
                # optional dependency) or have side effects; a name it has not resolved yet
                # resolves later through loss_utils, already replaced.
                namespace = getattr(module, "__dict__", None)
                if (name == "transformers" or name.startswith("transformers.")) and \
                        isinstance(namespace, dict) and \
                        namespace.get("ForCausalLMLoss") is original:
                    _replace(namespace, "ForCausalLMLoss", original)
        except BaseException as exc:
            done = len(_MAPPING_SAVED)
            revert_loss_mapping_locked()
            raise RuntimeError(
                f"apply_fused_ce_to_loss_mapping failed after replacing {done} entries "
                f"({type(exc).__name__}: {exc}); all were restored, LOSS_MAPPING and the "
                f"ForCausalLMLoss names are transformers' own again"
            ) from exc


def _replace(namespace: dict, key, original) -> None:
    """Record then replace one entry (record first: a failure leaves nothing unrecorded)."""
    _MAPPING_SAVED.append((namespace, key, original))
    namespace[key] = ForCausalLMLoss


def revert_loss_mapping() -> None:
    """Undo :func:`apply_fused_ce_to_loss_mapping` (entries changed since are left alone)."""
    with _MAPPING_LOCK:
        revert_loss_mapping_locked()


def revert_loss_mapping_locked() -> None:
    """:func:`revert_loss_mapping` for a caller that holds ``_MAPPING_LOCK``."""
    while _MAPPING_SAVED:
        namespace, key, original = _MAPPING_SAVED.pop()
        if namespace.get(key) is ForCausalLMLoss:
            namespace[key] = original


def loss_mapping_patched() -> bool:
    """True while :func:`apply_fused_ce_to_loss_mapping` is in effect."""
    return bool(_MAPPING_SAVED)

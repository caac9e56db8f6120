"""TRL's own fused heads compute with fused_ce_patch's kernel for models patched by us.

TRL installs its own chunked LM head on the model instance, replacing the forward we patch:

- trl >= 1.15: ``trl.trainer.utils.add_fused_lm_head`` (SFT, DPO, KTO, GRPO, RLOO); its forward,
  called with ``fused_lm_head=True``, runs the backbone, masks the labels and calls the
  module-level ``trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets,
  temperature, chunk_size, softcap, logit_scale, outputs)`` for per-token ``log_probs``,
  ``entropy``, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``.
- trl 1.6-1.14 (``loss_type="chunked_nll"``, the default from 1.7): ``SFTTrainer`` patches the
  forward (``_patch_chunked_ce_lm_head``) to call the module-level
  ``trl.trainer.sft_trainer._chunked_cross_entropy_loss(hidden_states, weight, chunk_size, labels,
  shift_labels, num_items_in_batch, logit_scale, final_logit_softcapping, lm_head_bias)`` for
  ``(loss, num_correct, entropy_sum, num_valid)``.

Everything around those calls (backbone, masking, loss reduction, MoE aux loss, metrics) stays
TRL's. While some model is patched by :func:`~fused_ce_patch.apply_fused_ce`, each of those two
module attributes is replaced by a router that computes with
:func:`~fused_ce_patch.fused_linear_token_stats` when the ``weight`` it receives is the lm_head
weight of a patched instance, and calls TRL's own function, unchanged, for every other model —
so a model that was never patched sees TRL's exact behaviour. The originals come back when the
last patched instance is reverted or garbage-collected (a ``weakref.finalize`` per patched
instance), whichever comes first. Each routed call tells the kernel which tile TRL's function
would hold (:mod:`fused_ce_patch.tile_policy`): with the default budget it never holds more
transient logits than TRL's own kernel would. All five fields of trl 1.16 are produced; a field
a later TRL adds that we do not know goes to TRL's kernel for that call, with one log message. Class-level
patches (``apply_fused_ce_to_<arch>``) are not routed: they have no instance to recognise the
weight by. Nor is an FSDP2 head: TRL hands the kernel ``weight.full_tensor()``, a new tensor, so
TRL's kernel runs there (DeepSpeed ZeRO-3 gathers the parameter in place and is routed).

- trl >= 1.16: ``DistillationTrainer`` computes its generalized JSD loss through the
  module-level ``trl.trainer.distillation_trainer._chunked_divergence_loss(student_hidden,
  teacher_hidden, student_weight, teacher_weight, completion_mask, beta, ...)`` for
  ``(loss, entropy_sum, n_valid)``; when the student's lm_head weight is a patched instance's,
  :func:`~fused_ce_patch.fused_linear_jsd` computes it (the teacher detached, as TRL's kernel
  gives it no gradient).

Source: trl 1.16.0 ``trainer/utils.py``, ``kernels/chunked_logprob.py``,
``trainer/distillation_trainer.py``; trl 1.10.0 and 1.6.0 ``trainer/sft_trainer.py``.
"""

from __future__ import annotations

import logging
import math
import sys
import weakref

import torch

from .. import errors as _errors
from ..tile_policy import TRL_CHUNKED_NLL, TRL_LOGPROB, ReplacedTiling
from ..token_stats import ForwardGradHint, fused_linear_token_stats

logger = logging.getLogger(__name__)

#: Per-token fields of TRL's fused head that fused_linear_token_stats produces.
SUPPORTED_FIELDS = frozenset(
    {"log_probs", "entropy", "is_top1", "mean_logits", "log_sum_sq_probs"}
)

_ORIGINALS: dict = {}  # (module name, attribute) -> TRL's object
_said: set = set()
#: One ForwardGradHint per patched model: TRL's SFT loss is a mean of the log-probabilities,
#: so their gradient can be formed in forward; DPO/GRPO weights turn the hint off after
#: their first backward (fused_ce_patch.token_stats.ForwardGradHint).
_HINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _grad_hint(model) -> ForwardGradHint:
    hint = _HINTS.get(model)
    if hint is None:
        hint = _HINTS[model] = ForwardGradHint()
    return hint


def _once(key, msg, *args):
    if key not in _said:
        _said.add(key)
        logger.warning(msg, *args)


def _patched_owner(weight):
    """``(model, options)`` of the patched instance whose lm_head weight is ``weight``, else
    None."""
    from . import registry
    from .forward import STATE_ATTR
    from .head import parametrized_anywhere

    for model in list(registry.PATCHED_INSTANCES):
        state = model.__dict__.get(STATE_ATTR)
        if state is None or state.options.return_logits:
            continue
        try:
            head = model.get_output_embeddings()
        except Exception:  # noqa: BLE001 - a model without a head is simply not ours
            continue
        if head is None or parametrized_anywhere(head):
            # reading a parametrized weight evaluates it (and may update its state, e.g.
            # spectral_norm's power iteration), which only the model's own call may do; the
            # tensor TRL passes is then another evaluation, never this model's weight by identity
            continue
        if getattr(head, "weight", None) is weight:
            from .head import custom_torch_function

            if custom_torch_function(weight):  # fake-quant / QAT weight: TRL's kernel, as stock
                _once(("custom", type(weight)), "fused_ce_patch: the lm_head weight is a %s "
                      "with its own __torch_function__; TRL's own kernel runs those calls",
                      type(weight).__qualname__)
                return None
            return model, state.options
    if registry.PATCHED_CLASSES:
        _once("class", "fused_ce_patch: a class-level patch does not reach TRL's fused LM head; "
              "use apply_fused_ce(model) (or the Trainer flag) to have TRL compute with "
              "fused_ce_patch")
    return None


def _match_dtypes(hidden, weight, bias):
    # TRL's kernels compute in hidden's dtype when autocast is off (cast_lm_head_to_fp32=True)
    if torch.is_autocast_enabled(hidden.device.type) or weight.dtype == hidden.dtype:
        return weight, bias
    return weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)


def _unusual(softcap, logit_scale, temperature=1.0) -> str | None:
    """Transform operands fused_linear_token_stats refuses but TRL's own kernel computes with
    (a softcap <= 0, a zero or non-finite scale, a temperature <= 0): TRL's kernel takes them."""
    try:
        values = [float(logit_scale), float(temperature)]
        cap = None if softcap is None else float(softcap)
    except (TypeError, ValueError):
        return "a transform operand that is not a number"
    if cap is not None and not (math.isfinite(cap) and cap > 0):
        return f"softcap {cap}"
    if not all(math.isfinite(v) for v in values) or values[0] == 0 or values[1] <= 0:
        return f"logit_scale {values[0]}, temperature {values[1]}"
    return None


class _RoutedChunkedLogProb:
    """Stands in for ``trl.trainer.utils._ChunkedLogProbFunction`` (only ``.apply`` is used)."""

    def __init__(self, original):
        self.original = original

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size,
              final_logit_softcapping=None, logit_scale=1.0, outputs=None):
        found = _patched_owner(weight)
        options = None if found is None else found[1]
        args = (hidden, weight, bias, targets, temperature, chunk_size,
                final_logit_softcapping, logit_scale)
        if outputs is None:  # TRL's default asks for every field
            outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
        if options is None or _errors.cuda_graph_capturing(hidden.device):
            # (while a CUDA graph is captured: TRL's kernel, without our host label read)
            return self.original.apply(*args, outputs)
        unusual = _unusual(final_logit_softcapping, logit_scale, temperature)
        if unusual is not None:
            _once(("operands", unusual), "fused_ce_patch: TRL's fused head called with %s; "
                  "TRL's own kernel runs those calls", unusual)
            return self.original.apply(*args, outputs)
        missing = set(outputs) - SUPPORTED_FIELDS
        if missing:
            _once(("fields", tuple(sorted(missing))),
                  "fused_ce_patch: TRL's fused head asked for %s, which fused_ce_patch does not "
                  "compute; TRL's own kernel runs those calls", ", ".join(sorted(missing)))
            return self.original.apply(*args, outputs)
        w, b = _match_dtypes(hidden, weight, bias)
        stats = fused_linear_token_stats(
            hidden, w, targets, bias=b, softcap=final_logit_softcapping,
            logit_scale=float(logit_scale), temperature=float(temperature),
            entropy="entropy" in outputs, accuracy="is_top1" in outputs,
            mean_logits="mean_logits" in outputs,
            log_sum_sq_probs="log_sum_sq_probs" in outputs,
            logits_budget=options.logits_budget, backend=options.backend,
            grad_hint=_grad_hint(found[0]), replaces=_logprob_tiling(self.original, chunk_size),
        )
        return (stats.log_probs.float(), _f32(stats.entropy), _f32(stats.log_sum_sq_probs),
                _f32(stats.mean_logits), stats.is_top1)


def _logprob_tiling(original, chunk_size) -> ReplacedTiling:
    """The logits tile TRL's ``ChunkedLogProbFunction`` would hold: ``TOKEN_CHUNK_SIZE`` rows
    (read from its module) by the ``chunk_size`` columns its caller passed."""
    module = sys.modules.get(getattr(original, "__module__", "") or "")
    rows = getattr(module, "TOKEN_CHUNK_SIZE", TRL_LOGPROB.rows)
    try:
        cols = int(chunk_size)
    except (TypeError, ValueError):
        cols = TRL_LOGPROB.cols
    return ReplacedTiling(TRL_LOGPROB.name, rows=max(1, int(rows)), cols=max(1, cols))


def _chunked_nll_tiling(chunk_size) -> ReplacedTiling:
    """trl 1.6-1.14's chunked_nll tile: ``chunk_size`` rows by the whole vocabulary, float32."""
    try:
        rows = max(1, int(chunk_size))
    except (TypeError, ValueError):
        rows = TRL_CHUNKED_NLL.rows
    return ReplacedTiling(TRL_CHUNKED_NLL.name, rows=rows, itemsize=TRL_CHUNKED_NLL.itemsize)


def _f32(x):
    return None if x is None else x.float()


def _trl_division(total, n_valid, num_items_in_batch):
    """TRL's own mean of a summed loss: ``total / n_valid.clamp(min=1)``, or ``/
    num_items_in_batch`` as given (a tensor's dtype and shape take part in the division)."""
    if num_items_in_batch is None:
        return total / n_valid.clamp(min=1)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _make_routed_chunked_ce(original):
    """Stands in for trl 1.6-1.14 ``sft_trainer._chunked_cross_entropy_loss``."""

    def routed(hidden_states, lm_head_weight, chunk_size, labels=None, shift_labels=None,
               num_items_in_batch=None, logit_scale=1.0, final_logit_softcapping=None,
               lm_head_bias=None):
        found = _patched_owner(lm_head_weight)
        options = None if found is None else found[1]
        if options is not None and (_unusual(final_logit_softcapping, logit_scale) is not None
                                    or _errors.cuda_graph_capturing(hidden_states.device)):
            options = None  # TRL's own function computes with these operands / in a capture
        if options is None:
            return original(hidden_states, lm_head_weight, chunk_size, labels=labels,
                            shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                            logit_scale=logit_scale,
                            final_logit_softcapping=final_logit_softcapping,
                            lm_head_bias=lm_head_bias)
        if labels is None and shift_labels is None:
            raise ValueError("At least one of `labels` or `shift_labels` must be provided.")
        if shift_labels is not None:
            target, shift = shift_labels, False
        else:
            target, shift = labels, True
        w, b = _match_dtypes(hidden_states, lm_head_weight, lm_head_bias)
        stats = fused_linear_token_stats(
            hidden_states, w, target.to(hidden_states.device), bias=b, shift=shift,
            softcap=final_logit_softcapping, logit_scale=float(logit_scale),
            entropy=True, accuracy=True,
            logits_budget=options.logits_budget, backend=options.backend,
            grad_hint=_grad_hint(found[0]), replaces=_chunked_nll_tiling(chunk_size),
        )
        n_valid = stats.mask.sum()
        loss = _trl_division(-stats.log_probs.sum(), n_valid, num_items_in_batch)
        correct = stats.is_top1.sum().float()
        entropy_sum = stats.entropy.detach().sum().float()
        return loss.float(), correct, entropy_sum, n_valid

    routed.__wrapped__ = original
    return routed


#: ``backend=`` of fused_linear_jsd for each fused_ce_patch backend name of the patch options
#: (the divergence has a Triton kernel and torch ops; Ascend NPUs run the torch ops).
_JSD_BACKEND = {"auto": "auto", "triton": "triton", "torch": "torch", "reference": "torch",
                "ascend": "torch"}


def _compute_dtype(hidden):
    # TRL's ChunkedDivergenceFunction projects in the autocast dtype when autocast is on,
    # else in the hidden states' dtype (trl 1.16 kernels/chunked_divergence.py)
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype


def _make_routed_divergence(original):
    """Stands in for trl >= 1.16 ``distillation_trainer._chunked_divergence_loss``: the
    generalized JSD of a patched student computed by :func:`~fused_ce_patch.fused_linear_jsd`
    (same ``(loss, entropy_sum, n_valid)``; the teacher gets no gradient, as in TRL)."""
    from .. import distill  # the function is read at each call (tests put a spy there)

    def routed(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
               teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
               student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
               teacher_logit_scale=1.0, student_final_logit_softcapping=None,
               teacher_final_logit_softcapping=None, temperature=1.0):
        args = (student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                teacher_lm_head_weight, completion_mask, beta)
        kwargs = dict(num_items_in_batch=num_items_in_batch,
                      student_lm_head_bias=student_lm_head_bias,
                      teacher_lm_head_bias=teacher_lm_head_bias,
                      student_logit_scale=student_logit_scale,
                      teacher_logit_scale=teacher_logit_scale,
                      student_final_logit_softcapping=student_final_logit_softcapping,
                      teacher_final_logit_softcapping=teacher_final_logit_softcapping,
                      temperature=temperature)
        found = _patched_owner(student_lm_head_weight)
        if found is None:
            return original(*args, **kwargs)
        why = _divergence_refusal(*args, **kwargs)
        if why is not None:
            _once(("jsd", why), "fused_ce_patch: TRL's distillation loss called with %s; "
                  "TRL's own kernel runs those calls", why)
            return original(*args, **kwargs)
        options = found[1]
        s_dtype = _compute_dtype(student_hidden_states)
        t_dtype = _compute_dtype(teacher_hidden_states)
        valid = completion_mask != 0
        labels = torch.where(valid, 0, -100).to(torch.int64)
        total, entropy = distill.fused_linear_jsd(
            student_hidden_states.to(s_dtype), student_lm_head_weight.to(s_dtype),
            teacher_hidden_states.detach().to(t_dtype),
            teacher_lm_head_weight.detach().to(t_dtype), labels,
            beta=float(beta), temperature=float(temperature), reduction="sum",
            student_bias=student_lm_head_bias,
            teacher_bias=None if teacher_lm_head_bias is None else teacher_lm_head_bias.detach(),
            student_logit_scale=float(student_logit_scale),
            teacher_logit_scale=float(teacher_logit_scale),
            student_softcap=student_final_logit_softcapping,
            teacher_softcap=teacher_final_logit_softcapping,
            logits_budget=options.logits_budget,
            backend=_JSD_BACKEND.get(options.backend, "auto"), return_student_entropy=True)
        # TRL's own reduction, dtypes and shapes included: its float32 per-token sums, then
        # its division (_trl_division)
        n_valid = valid.sum()
        loss = _trl_division(total.float(), n_valid, num_items_in_batch)
        return loss, entropy.float().sum(), n_valid

    routed.__wrapped__ = original
    return routed


def _divergence_refusal(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                        teacher_lm_head_weight, completion_mask, beta, *, num_items_in_batch,
                        student_lm_head_bias, teacher_lm_head_bias, student_logit_scale,
                        teacher_logit_scale, student_final_logit_softcapping,
                        teacher_final_logit_softcapping, temperature) -> str | None:
    """Why a distillation call should stay with TRL's kernel (operands fused_linear_jsd
    refuses or computes differently), or None."""
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None)
    if dtensor is not None and any(isinstance(t, dtensor) for t in (
            student_lm_head_weight, teacher_lm_head_weight)):
        return "a DTensor lm_head (FSDP2)"
    if _errors.cuda_graph_capturing(student_hidden_states.device):
        return "a CUDA graph being captured (fused_linear_jsd reads counts on the host)"
    if student_hidden_states.dim() not in (2, 3):
        return f"hidden states of {student_hidden_states.dim()} dimensions"
    for side, cap, scale in (("student", student_final_logit_softcapping, student_logit_scale),
                             ("teacher", teacher_final_logit_softcapping, teacher_logit_scale)):
        unusual = _unusual(cap, scale, temperature)
        if unusual is not None:
            return f"{side} {unusual}"
    try:
        b = float(beta)
    except (TypeError, ValueError):
        return "a beta that is not a number"
    if not 0.0 <= b <= 1.0:
        return f"beta {b}"
    for bias, hidden in ((student_lm_head_bias, student_hidden_states),
                         (teacher_lm_head_bias, teacher_hidden_states)):
        if bias is not None and bias.dtype != _compute_dtype(hidden):
            return f"an lm_head bias of dtype {bias.dtype}"  # TRL adds it unrounded
    if student_hidden_states.shape[:-1] != completion_mask.shape:
        return "a completion mask whose shape is not the hidden states'"
    return None


_ABSENT = object()

_TARGETS = (
    ("trl.trainer.utils", "_ChunkedLogProbFunction", _RoutedChunkedLogProb),
    ("trl.trainer.sft_trainer", "_chunked_cross_entropy_loss", _make_routed_chunked_ce),
    ("trl.trainer.distillation_trainer", "_chunked_divergence_loss", _make_routed_divergence),
)


def install() -> None:
    """Put the routers in place in every TRL module already imported (idempotent), and watch
    every patched instance so that the originals come back when the last one is garbage
    collected, reverted or not.

    A TRL module imported later (``apply_fused_ce`` before ``import trl``, or after it but
    before a TRL trainer is imported: trl loads its trainer modules lazily) gets its router
    when it is imported, through a finder on ``sys.meta_path`` that only answers for those
    modules and is there only while a patched instance exists (:class:`_RouteOnImport`)."""
    _install_now()
    from . import registry

    pending = [name for name, _, _ in _TARGETS if name not in sys.modules]
    if pending and any(True for _ in registry.PATCHED_INSTANCES) and _trl_installed():
        if _HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _HOOK)
        _watch_patched_instances()
    elif not pending:
        _remove_hook()


def _trl_installed() -> bool:
    if "trl" in sys.modules:
        return True
    import importlib.util

    try:
        return importlib.util.find_spec("trl") is not None
    except (ImportError, ValueError):
        return False


def _install_now() -> None:
    for module_name, attr, make in _TARGETS:
        module = sys.modules.get(module_name)
        if module is None or (module_name, attr) in _ORIGINALS:
            continue
        original = getattr(module, attr, _ABSENT)
        if original is _ABSENT or (original is None and make is not _RoutedChunkedLogProb):
            continue
        # trl >= 1.15 sets _ChunkedLogProbFunction = None where Triton is not importable, and
        # its head then fails; the router computes patched models' calls and hands the others
        # to that None exactly as TRL would (the same AttributeError).
        _ORIGINALS[(module_name, attr)] = original
        setattr(module, attr, make(original))
    if _ORIGINALS:
        _watch_patched_instances()


class _InstallAfter:
    """The loader of one TRL module, running :func:`install` once the module has executed."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        from . import registry

        if any(True for _ in registry.PATCHED_INSTANCES):  # e.g. not on a reload after release
            install()

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self.loader, name)


class _RouteOnImport:
    """``sys.meta_path`` finder for TRL's two routed modules only: finds them with the other
    finders, then has their loader install the routers right after the module runs."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _TARGET_MODULES:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _InstallAfter(spec.loader)
                return spec
        return None

    def invalidate_caches(self):
        pass


_HOOK = _RouteOnImport()
_TARGET_MODULES = frozenset(name for name, _, _ in _TARGETS)


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_HOOK)
    except ValueError:
        pass


def release() -> None:
    """Give TRL its exact objects back (called when no patched instance is left), and stop
    watching for TRL's modules being imported.

    Safe to re-enter (a finalizer may run it while another call is in progress)."""
    _remove_hook()
    for key in list(_ORIGINALS):
        original = _ORIGINALS.pop(key, _ABSENT)
        module = sys.modules.get(key[0])
        if original is not _ABSENT and module is not None:
            setattr(module, key[1], original)


_WATCHED: weakref.WeakSet = weakref.WeakSet()  # patched instances that carry a finalizer


def _watch_patched_instances() -> None:
    """Give each patched instance (deep copies included) a finalizer that releases TRL's
    attributes if it was the last one. The finalizer holds no reference to the model and does
    not run at interpreter exit (nothing needs restoring then)."""
    from . import registry

    for model in list(registry.PATCHED_INSTANCES):
        if model not in _WATCHED:
            _WATCHED.add(model)
            weakref.finalize(model, _instance_gone).atexit = False


def _instance_gone() -> None:
    """Finalizer of a patched instance. It runs wherever the garbage collector happens to
    run, so it is tiny and never raises: release when no patched instance is left (the dead
    one is already out of the weak set), else watch the survivors (a deep copy made after
    the last ``install``)."""
    try:
        registry = sys.modules.get("fused_ce_patch.hf.registry")
        if not (_ORIGINALS or _HOOK in sys.meta_path) or registry is None:
            return
        if any(True for _ in registry.PATCHED_INSTANCES):
            _watch_patched_instances()
        else:
            release()
    except Exception:  # noqa: BLE001 - a finalizer must not raise into arbitrary code
        pass


def is_installed() -> bool:
    return bool(_ORIGINALS)


def is_trl_head_forward(fn) -> bool:
    """Whether ``fn`` (an instance's ``forward``) is a fused head TRL installed.

    Recognised by code object (name and a file under a ``trl`` folder): ``add_fused_lm_head``'s
    ``_fused_forward`` (trl >= 1.15) and ``_patch_chunked_ce_lm_head``'s
    ``_chunked_ce_forward`` (trl 1.6-1.14), bound to the instance, or inside accelerate's
    mixed-precision wrapper (:func:`~.registry.inside_amp_wrapper`).
    """
    # By code object: trl 1.16 wraps _fused_forward with functools.wraps(type(model).forward),
    # which copies the class forward's __module__ and __qualname__ onto it. accelerate's
    # mixed-precision wrapper (bf16/fp16 Trainer, TRL's default) is looked through.
    from .registry import inside_amp_wrapper

    inner = inside_amp_wrapper(fn)
    code = getattr(getattr(inner, "__func__", None) if inner is fn else inner, "__code__", None)
    if code is None:
        return False
    in_trl = "trl" in code.co_filename.replace("\\", "/").split("/")
    return in_trl and code.co_name in ("_fused_forward", "_chunked_ce_forward")


# -- loss_type="nll" (trl <= 1.6 default; explicit later) ------------------------------------


def _is_sft_trainer(trainer) -> bool:
    module = sys.modules.get("trl.trainer.sft_trainer")
    cls = getattr(module, "SFTTrainer", None)
    return cls is not None and isinstance(trainer, cls)


def convert_nll_sft_trainer(trainer, target) -> object | None:
    """Give a TRL ``SFTTrainer`` with ``loss_type="nll"`` TRL's own ``chunked_nll`` head.

    With ``"nll"``, ``SFTTrainer.compute_loss`` computes its ``entropy`` and
    ``mean_token_accuracy`` metrics from ``outputs.logits`` (trl 1.6, 1.10), which the fused
    path never builds. TRL's ``chunked_nll`` head computes the same loss and both metrics
    without logits, and its kernel is routed to fused_ce_patch; so the model gets that head
    (``_patch_chunked_ce_lm_head``, as ``SFTTrainer.__init__`` would install it), and this
    trainer's ``compute_loss`` reads ``args.loss_type`` as ``"chunked_nll"`` during each call
    while the head is in place (the arguments object is left as it was between calls).

    Returns what the instance held under ``forward`` before (for revert), or None when the
    trainer needs nothing (not an SFTTrainer, another loss type, Liger, a custom loss, a PEFT
    adapter on lm_head, a ``get_output_embeddings()`` that raises or returns None: then
    :func:`~fused_ce_patch.apply_fused_ce` refuses the model, or the Trainer flag trains it
    unpatched, each saying why) or cannot have it (a TRL without the chunked head, or
    ``compute_metrics`` that needs eval logits: then one warning says TRL's training metrics
    need ``return_logits=True``).
    """
    module = sys.modules.get("trl.trainer.sft_trainer")
    patch_head = getattr(module, "_patch_chunked_ce_lm_head", None)
    args = trainer.args
    if is_trl_head_forward(target.__dict__.get("forward")):
        return None  # TRL's own head is already there (trl >= 1.15, or chunked_nll)
    if getattr(sys.modules.get("trl.trainer.utils"), "add_fused_lm_head", None) is not None:
        # trl >= 1.15: SFTTrainer installs its fused head right after Trainer.__init__ (where
        # this runs), whatever the loss type, and its kernel is routed to us
        return None
    if (not _is_sft_trainer(trainer) or getattr(args, "loss_type", "nll") != "nll"
            or args.use_liger_kernel or trainer.compute_loss_func is not None
            or trainer.label_smoother is not None):
        return None
    if patch_head is None or trainer.compute_metrics is not None \
            or trainer.preprocess_logits_for_metrics is not None:
        # TRL's chunked head returns no logits, which compute_metrics would need
        logger.warning(
            "fused_ce_patch: this SFTTrainer (loss_type='nll') computes its entropy and "
            "mean_token_accuracy from outputs.logits, which the fused path does not build; "
            "pass FusedCECallback(return_logits=True) (or use_fused_ce with "
            "fused_ce_return_logits=True) to keep them, or drop compute_metrics")
        return None
    try:
        head = target.get_output_embeddings()
    except Exception:  # noqa: BLE001 - apply_fused_ce refuses such a model and says why
        return None
    if head is None:  # no vocabulary head: nothing for TRL's chunked head to project with
        return None
    if "peft" in sys.modules and isinstance(
        head, sys.modules["peft"].tuners.tuners_utils.BaseTunerLayer
    ):
        return None
    if not _forward_calls_projection(target, head):
        # TRL's chunked head multiplies the backbone's hidden states by the projection's
        # weight: a head transform before it (RoBERTa, BERT) would be skipped
        logger.warning(
            "fused_ce_patch: %s's head has a transform before its vocabulary projection, which "
            "TRL's chunked_nll head would skip; this SFTTrainer (loss_type='nll') computes its "
            "entropy and mean_token_accuracy from outputs.logits: pass "
            "FusedCECallback(return_logits=True) (or use_fused_ce with "
            "fused_ce_return_logits=True) to keep them", type(target).__name__)
        return None
    from .registry import MISSING as _MISSING

    before = target.__dict__.get("forward", _MISSING)
    chunk = getattr(module, "_CHUNKED_LM_HEAD_CHUNK_SIZE", 256)
    patch_head(target, chunk_size=chunk, is_vlm=getattr(trainer, "_is_vlm", False))
    _wrap_compute_loss(trainer, target)
    logger.info("fused_ce_patch: SFTTrainer(loss_type='nll') reads logits for its metrics; "
                "this trainer uses TRL's chunked_nll head, computed by fused_ce_patch")
    return before


def _forward_calls_projection(target, head) -> bool:
    """Whether ``target``'s forward calls its ``get_output_embeddings()`` itself as the head
    (not a head module with a transform before it, :mod:`.head_path`)."""
    from ..errors import UnsupportedModelError
    from .architectures import derive_spec

    try:
        attr = derive_spec(type(target)).head_attr
    except UnsupportedModelError:
        return True  # not a forward we rewrite: nothing of ours to keep consistent
    return getattr(target, attr, None) is head


def _wrap_compute_loss(trainer, target) -> None:
    import functools
    import weakref

    if "compute_loss" in trainer.__dict__:
        return
    original = trainer.compute_loss
    target_ref = weakref.ref(target)

    @functools.wraps(original)
    def compute_loss(model, inputs, *args, **kwargs):
        owner = target_ref()
        if owner is None or not is_trl_head_forward(owner.__dict__.get("forward")):
            return original(model, inputs, *args, **kwargs)  # reverted: stock behaviour
        config = trainer.args
        saved = config.loss_type
        config.loss_type = "chunked_nll"
        try:
            return original(model, inputs, *args, **kwargs)
        finally:
            config.loss_type = saved

    trainer.compute_loss = compute_loss

"""Proving a class on the user's machine: the live stock forward against the patched copy.

A class is patched only after :func:`prove` has compared, on a tiny random model of that class
built here and now, the stock model (the class as it is at proof time: its ``forward`` as bound,
wrappers included; the loss function in force) with a deep copy patched by
:func:`~fused_ce_patch.apply_fused_ce`: the training loss, every parameter gradient and the MoE
router aux loss, on the parity sweep's three batches (right padding, ``num_items_in_batch``,
``shift_labels``). It runs in float64 (loss within 1e-6, gradients within 1e-5 relative: the
stock loss itself rounds the logits to float32), or in float32 (1e-5, 1e-4) when the stock
model cannot run in float64 (e.g. MoE experts through ``torch._grouped_mm``).
The patched copy must prove that the fused path ran: its ``outputs.logits`` is the
:class:`~fused_ce_patch.hf.sentinel.NotMaterializedLogits` sentinel, the stock one a tensor.
The tiny model runs on the CPU; where its stock forward cannot (a device-only kernel patched
into the modeling module, such as Liger-Kernel's Triton RMSNorm), the proof runs again on the
user's model's device (:func:`prove`).

The proof runs in a clean context whatever the caller's (:mod:`.clean_context`): grad enabled,
outside ``inference_mode``, autocast, deterministic algorithms, function and dispatch modes,
float32 default dtype; and nothing outside it notices it: the random streams (torch CPU and
CUDA, Python's, NumPy's) are restored, grad mode, the default dtype, warning filters,
transformers' log verbosity and its ``warning_once`` caches are left as found, the package's
own log records about the tiny copy are held back by a filter removed afterwards, and the tiny
patched copy is reverted. A refusal seen while the caller had such a context set is not kept
in the process's memo.

Results are kept per process (key: the class, its spec's fingerprint, the forward as bound and
the causal-LM loss objects in force) and, for passes only, on disk under
``<cache>/proofs/<key>.json``, where ``<cache>`` is ``$FUSED_CE_CACHE_DIR``, else
``$FUSED_CE_PATCH_CACHE``, else ``$XDG_CACHE_HOME/fused_ce_patch``, else
``~/.cache/fused_ce_patch`` (never the installed package). The disk key covers every input of
the result: Python, torch and transformers versions, the class's module file and the source of
each function its ``forward`` chain runs, the model type, the source of the causal-LM loss in
force, and this package's own sources that compute the fused path. When one of them has no
source to hash, the disk cache is skipped. An unwritable cache directory or a corrupt file is
ignored (the proof just runs again).

The parity sweep (:mod:`.sweep`) runs :func:`prove` for every registry type without the caches.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import inspect
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from ..errors import UnsupportedModelError
from .clean_context import caller_context

__all__ = ["ensure_proven", "prove", "proving", "cache_dir", "disk_key", "clear_memo"]

logger = logging.getLogger(__name__)

#: Relative tolerances by dtype: loss, gradients (gradients floored at 1e-3 of the largest
#: gradient norm, as in the sweep: a gradient that is zero in exact arithmetic is rounding
#: noise on both sides). float64 is not tighter than ~1e-7: transformers' ForCausalLMLoss
#: computes the stock loss from ``logits.float()``, so a float64 model's stock loss and logits
#: gradient carry float32 rounding (measured: up to 1.3e-7 loss, 1.8e-7 gradients on Llama,
#: Gemma-2, Cohere, Granite, GPT-2, Falcon-H1), while the fused side is float64 throughout.
TOLERANCES = {torch.float64: (1e-6, 1e-5), torch.float32: (1e-5, 1e-4)}
#: A ``CrossEntropyLoss``-block class (spec ``loss_form == "cross_entropy"``) computes its
#: stock loss in the model's dtype: in float64 both sides are float64 throughout and differ by
#: summation order only (measured <= 4e-16 loss, 8e-15 gradients on the BART family, CPM-Ant,
#: TrOCR, Whisper, XLNet), so a float64 proof of such a class is held to 1e-10 / 1e-9.
EXACT_TOLERANCES = {torch.float64: (1e-10, 1e-9)}
GRAD_FLOOR = 1e-3

CACHE_ENV = "FUSED_CE_CACHE_DIR"
#: Bumped when what a cached proof means changes.
PROOF_FORMAT = 1
#: Our modules whose code decides the fused number (hashed into the disk key).
_OWN_SOURCES = ("hf/architectures.py", "hf/forward.py", "hf/head.py", "hf/head_path.py",
                "loss.py", "token_stats.py", "hf/softcap_call.py", "hf/source_check.py",
                "hf/clean_context.py", "hf/tiny.py", "hf/live_config.py",
                "hf/proof.py", "hf/sweep.py")
SUPPORT_TABLE = ("docs/support.md lists the model types proven on each transformers release")

_MEMO: dict = {}
_PROVING: contextvars.ContextVar = contextvars.ContextVar("fused_ce_proving", default=False)


def proving() -> bool:
    """True while :func:`prove` runs its tiny models (in this thread / context), so that
    instrumentation of the fused loss (a test's spy, a user's counter) can tell the proof's
    calls from the model's."""
    return _PROVING.get()


def clear_memo() -> None:
    """Forget this process's proofs (the disk cache stays)."""
    _MEMO.clear()


# -- the proof ---------------------------------------------------------------------------------


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def _config_for(cls: type, model_type: str | None):
    """The sweep's tiny config for ``model_type`` (else the class's own), fitted to ``cls``."""
    from transformers import CONFIG_MAPPING

    from .tiny import tiny_config

    candidates = [model_type, getattr(getattr(cls, "config_class", None), "model_type", None)]
    name = next((t for t in candidates if t and t in CONFIG_MAPPING), None)
    if name is None:
        raise LookupError(f"no transformers config is registered for model_type "
                          f"{model_type!r} (class config {candidates[1]!r})")
    config = tiny_config(name)
    if not isinstance(config, cls.config_class) and hasattr(config, "get_text_config"):
        # a text-only class under a composite config's model_type
        config = config.get_text_config()
        config._attn_implementation = "eager"
    return config


def _uses_patched_class_forward(cls: type) -> bool:
    from .registry import is_patched_forward

    fn = cls.forward
    for _ in range(32):
        if fn is None:
            return False
        if is_patched_forward(fn):
            return True
        fn = getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
    return False


class _Unbuildable(Exception):
    """The tiny model cannot be built or cannot run its stock forward (not a parity failure)."""


def _run_stock(model, batches, class_patched):
    """Loss, aux loss and gradients of the stock model on each batch."""
    from .sentinel import NotMaterializedLogits

    results = {}
    for name, batch in batches.items():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        # A class patched by apply_fused_ce_to_class: the stock path of its patched forward.
        out = model(**batch, skip_logits=False) if class_patched else model(**batch)
        if out.loss is None:
            raise _Unbuildable(f"stock {name}: the stock forward returned no loss")
        if isinstance(out.logits, NotMaterializedLogits):
            raise _Unbuildable(f"stock {name}: the stock model took a fused path")
        if not torch.isfinite(out.loss):
            raise _Unbuildable(f"stock {name}: the stock loss of the tiny model is "
                               f"{out.loss.item()}")
        out.loss.backward()
        grads = {k: (None if p.grad is None else p.grad.detach().clone())
                 for k, p in model.named_parameters()}
        aux = getattr(out, "aux_loss", None)
        results[name] = (out.loss.detach().clone(),
                         None if aux is None else aux.detach().clone(), grads)
    model.zero_grad(set_to_none=True)
    return results


def _tolerances(dtype, loss_form: str = "loss_function"):
    """``(loss, gradient)`` relative tolerances of a proof in ``dtype`` for a spec's loss form."""
    if loss_form == "cross_entropy" and dtype in EXACT_TOLERANCES:
        return EXACT_TOLERANCES[dtype]
    return TOLERANCES[dtype]


def _compare(model, batches, want, dtype, fused=True, loss_form="loss_function"):
    """Run the patched copy; None when it matches ``want``, else the first difference.
    ``fused=False``: the copy must match without the fused path (the stock path it took)."""
    from .sentinel import NotMaterializedLogits

    loss_tol, grad_tol = _tolerances(dtype, loss_form)
    worst = {"loss": 0.0, "grad": 0.0}
    for name, batch in batches.items():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        out = model(**batch)
        if fused and not isinstance(out.logits, NotMaterializedLogits):
            return f"{name}: the fused path did not run (outputs.logits is real)", worst
        want_loss, want_aux, want_grads = want[name]
        if out.loss is None:
            return f"{name}: no loss (stock {want_loss.item():.10g})", worst
        err = _rel_err(out.loss, want_loss)
        if not torch.isfinite(out.loss) or err > loss_tol:
            worst["loss"] = err
            return (f"{name}: loss {out.loss.item():.10g} vs stock {want_loss.item():.10g} "
                    f"(relative error {err:.2e}, tolerance {loss_tol:.0e})"), worst
        worst["loss"] = max(worst["loss"], err)
        aux = getattr(out, "aux_loss", None)
        if (aux is None) != (want_aux is None):
            return f"{name}: aux_loss is None on one side only", worst
        if aux is not None and _rel_err(aux, want_aux) > loss_tol:
            return (f"{name}: aux_loss {aux.item():.10g} vs stock {want_aux.item():.10g}"), worst
        out.loss.backward()
        floor = GRAD_FLOOR * max((g.norm().item() for g in want_grads.values()
                                  if g is not None), default=0.0)
        for pname, p in model.named_parameters():
            q = want_grads.get(pname)
            if (p.grad is None) != (q is None):
                side = "fused" if p.grad is None else "stock"
                return f"{name}: gradient of {pname} is None on the {side} side only", worst
            if q is None:
                continue
            diff = (p.grad.double() - q.double()).norm().item()
            gerr = diff / max(q.norm().item(), floor, 1e-300)
            if not torch.isfinite(p.grad).all() or gerr > grad_tol:
                worst["grad"] = gerr
                return (f"{name}: gradient of {pname} differs (relative error {gerr:.2e}, "
                        f"tolerance {grad_tol:.0e})"), worst
            worst["grad"] = max(worst["grad"], gerr)
    return None, worst


class _DropRecords(logging.Filter):
    def filter(self, record):  # the tiny copy's "patched ..." lines are not the user's model
        return False


@contextlib.contextmanager
def _isolated(dev: torch.device):
    """The caller's context set aside (:func:`~.clean_context.clean_context`: grad, inference
    mode, autocast, modes, determinism, RNG, "once" caches), warnings and transformers' notes
    silenced, our logs about the tiny copy held back; all as found afterwards."""
    from transformers.utils import logging as hf_logging

    from .clean_context import clean_context

    verbosity = hf_logging.get_verbosity()
    quiet = _DropRecords()
    ours = [logging.getLogger(n) for n in ("fused_ce_patch.hf.patch", "fused_ce_patch.hf.trl",
                                           "fused_ce_patch.hf.loss_mapping")]
    token = _PROVING.set(True)
    try:
        hf_logging.set_verbosity_error()  # the tiny config's notes are not about the user's model
        for lg in ours:
            lg.addFilter(quiet)
        with clean_context(dev, proving), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        _PROVING.reset(token)
        for lg in ours:
            lg.removeFilter(quiet)
        hf_logging.set_verbosity(verbosity)


#: ``(apply_fused_ce, revert_fused_ce)``, registered by :mod:`.patch` when it is imported (the
#: patch calls the proof; the proof patches a tiny copy: the functions come in, no import).
_PATCHER: list = []


def register_patcher(apply, revert) -> None:
    """Set the functions :func:`prove` patches and reverts its tiny copy with."""
    _PATCHER[:] = [apply, revert]


def prove(cls: type, spec, model_type: str | None = None, device=None, config=None) -> dict:
    """Compare ``cls``'s live stock forward with the patched copy on a tiny random model.

    The tiny model runs on the CPU. Where its stock forward cannot run there (a module the
    user's process replaced with a device-only kernel, e.g. Liger-Kernel's Triton RMSNorm,
    RoPE and GeGLU patched into transformers' modeling module) and ``device`` is another
    device, the whole proof runs again on ``device`` (its RNG forked too) and that result
    counts; the row then has ``device`` and ``cpu_reason``.

    Args:
        cls: the transformers causal-LM class (the one the user's model is an instance of).
        spec: its :class:`~fused_ce_patch.hf.architectures.ArchSpec` (already derived).
        model_type: ``config.model_type`` of the user's model; None: ``cls.config_class``'s.
        device: the user's model's device (``torch.device`` or str), or None.
        config: the user's model's ``config`` (None for a class-level patch): the tiny model is
            built from it (:mod:`.live_config`: as it is when small, else shrunk), and from the
            class's default config only where that does not build or run.

    Returns:
        A result row: ``status`` (``"pass"``; ``"fail"``: the numbers differ; ``"unbuildable"``:
        no tiny model could be built or run stock; ``"unsupported"``: apply_fused_ce refused the
        copy; ``"error"``: the fused copy raised), ``reason`` (all but pass), ``config`` (which
        config the model was built from), ``fallback_from`` (the reasons of the configs tried
        before it), ``dtype``,
        ``loss_rel_err`` / ``grad_rel_err`` (worst seen) and ``seconds``. Never raises for a
        model-specific problem.

    Source: the parity sweep of issue 10 (:mod:`.sweep`), moved to the user's machine.
    """
    if not _PATCHER:
        raise RuntimeError("fused_ce_patch.hf.proof needs fused_ce_patch.hf.patch imported")
    row = _prove_on(cls, spec, model_type, torch.device("cpu"), config)
    dev = _retry_device(device)
    if dev is not None and _stock_failed(row):
        cpu_reason = row["reason"]
        try:
            row = _prove_on(cls, spec, model_type, dev, config)
        except Exception as exc:  # noqa: BLE001 - the retry itself could not be set up
            row = {"status": "unbuildable", "reason": f"{type(exc).__name__}: {_short(exc)}"}
        row.update(device=str(dev), cpu_reason=cpu_reason)
        if row["status"] != "pass":
            row["reason"] = f"on {dev}: {row.get('reason', '')}; on cpu: {cpu_reason}"
    return row


def _retry_device(device) -> torch.device | None:
    """``device`` as a ``torch.device`` where a proof could run there, else None."""
    if device is None:
        return None
    dev = torch.device(device)
    return None if dev.type in ("cpu", "meta") else dev


def _stock_failed(row: dict) -> bool:
    """Whether the tiny stock model was built but its forward raised (see :func:`prove`)."""
    return row["status"] == "unbuildable" and "stock forward" in row.get("reason", "")


def _build_and_run_stock(cls, config, dev, class_patched):
    """A copy of the tiny stock model of ``config`` on ``dev`` (made before the stock run, for
    patching), its batches, dtype and the stock results.

    Raises:
        _Unbuildable: the model cannot be built ("tiny model: ...") or its stock forward
            raised in float64 and float32 ("stock forward: ...").
    """
    from .tiny import _batches

    torch.manual_seed(0)
    if isinstance(config, Exception):
        raise _Unbuildable(f"tiny model: {type(config).__name__}: {_short(config)}")
    try:
        base = cls(config)
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to report
        raise _Unbuildable(f"tiny model: {type(exc).__name__}: {_short(exc)}") from None
    base.train()
    with torch.device("cpu"):  # the batches come from a CPU generator
        batches = _batches(config, torch)
    if dev.type != "cpu":
        batches = {name: {k: v.to(dev) if isinstance(v, torch.Tensor) else v
                          for k, v in batch.items()} for name, batch in batches.items()}
    for dtype in (torch.float64, torch.float32):
        stock = base.to(dtype)
        patched = copy.deepcopy(stock)  # before the stock run: no state of it is copied
        try:
            return patched, batches, dtype, _run_stock(stock, batches, class_patched)
        except _Unbuildable:
            raise
        except Exception as exc:  # noqa: BLE001
            if dtype is torch.float32:
                raise _Unbuildable(f"stock forward: {type(exc).__name__}: "
                                   f"{_short(exc)}") from None
    raise AssertionError("unreachable")


class _SteppedAside(Exception):
    """The patched copy took the stock path on every batch of a live config (e.g. Gemma-2's
    negative softcap) with stock's numbers: the fused path is proven on the next config."""


def _prove_on(cls: type, spec, model_type: str | None, dev: torch.device,
              config=None) -> dict:
    """:func:`prove` on one device: on the live ``config``'s candidates
    (:func:`~.live_config.candidates`), then the class default, the first whose stock model
    builds and runs (and whose patched copy takes the fused path)."""
    from .live_config import candidates

    start = time.perf_counter()
    row: dict = {"status": "error", "reason": ""}
    with _isolated(dev):
        class_patched = _uses_patched_class_forward(cls)
        tried = candidates(cls, config) if config is not None else []
        tried.append(("the class's default config", None))
        failures = []
        for i, (label, cfg) in enumerate(tried):
            last = i == len(tried) - 1
            try:
                row = _prove_config(cls, model_type, dev, cfg, class_patched,
                                    label if config is not None else None, last)
                row["config"] = label
                break
            except _Unbuildable as exc:
                failures.append(f"{exc} ({label})" if len(tried) > 1 else str(exc))
            except _SteppedAside as exc:
                failures.append(f"{exc} ({label})")
        else:
            row = {"status": "unbuildable", "reason": "; ".join(failures)}
        if failures and row["status"] != "unbuildable":
            row["fallback_from"] = "; ".join(failures)
        row["seconds"] = round(time.perf_counter() - start, 3)
    if not row.get("reason"):
        row.pop("reason", None)
    return row


def _prove_config(cls, model_type, dev, cfg, class_patched, label, last) -> dict:
    """Stock against patched on one config (None: the class default); a result row.

    Raises:
        _Unbuildable: no stock model of ``cfg`` builds or runs.
        _SteppedAside: ``cfg`` is not the last candidate and the patched copy took the stock
            path with stock's numbers.
    """
    apply_fused_ce, revert_fused_ce = _PATCHER
    if cfg is None:
        try:
            cfg = _config_for(cls, model_type)
        except Exception as exc:  # noqa: BLE001
            raise _Unbuildable(f"tiny model: {type(exc).__name__}: {_short(exc)}") from None
    patched, batches, dtype, want = _build_and_run_stock(cls, cfg, dev, class_patched)
    row = {"status": "error", "reason": "", "dtype": str(dtype).replace("torch.", "")}
    try:
        try:
            apply_fused_ce(patched, backend="torch", _verified=True)
        except UnsupportedModelError as exc:
            row.update(status="unsupported", reason=_short(exc, 400))
            return row
        try:
            reason, worst = _compare(patched, batches, want, dtype,
                                     loss_form=_loss_form(patched))
        except Exception as exc:  # noqa: BLE001
            row.update(status="error", reason=f"the fused copy raised "
                       f"{type(exc).__name__}: {_short(exc)}")
            return row
        if reason is not None and "the fused path did not run" in reason and not last:
            with_stock_path = _compare(patched, batches, want, dtype, fused=False)[0]
            if with_stock_path is None:
                raise _SteppedAside("the patched copy took the stock path, as stock")
        row.update(loss_rel_err=worst["loss"], grad_rel_err=worst["grad"])
        if reason is None:
            row["status"] = "pass"
        else:
            row.update(status="fail", reason=f"{row['dtype']} {reason}"
                       + (f" ({label})" if label else ""))
        return row
    finally:
        revert_fused_ce(patched)


def _loss_form(model) -> str:
    """The loss form of ``model``'s class spec (``"loss_function"`` when not derivable)."""
    from .architectures import derive_spec

    try:
        return getattr(derive_spec(type(model)), "loss_form", "loss_function")
    except UnsupportedModelError:
        return "loss_function"


def _short(exc, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the caches ----------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``<cache>/proofs`` (see the module docstring); not created here."""
    root = os.environ.get(CACHE_ENV) or os.environ.get("FUSED_CE_PATCH_CACHE")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "fused_ce_patch"
    return base / "proofs"


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _own_source(fn) -> str:
    """The source lines of ``fn`` itself (``inspect.getsource`` would unwrap a wrapper)."""
    lines, lnum = inspect.findsource(fn)
    return "".join(inspect.getblock(lines[lnum:]))


def _forward_chain(cls: type) -> list[str]:
    """``module.qualname:sha:constants`` of every function in ``cls.forward``'s wrapper chain.

    Follows ``__wrapped__``; a wrapper's closure constants (e.g. a factor) and closed-over
    functions are part of what it computes, so they are hashed too.

    Raises:
        TypeError: something in the chain is not a Python function.
        OSError: a function has no source.
    """
    out, fn = [], cls.forward
    while fn is not None and len(out) < 32:
        func = getattr(fn, "__func__", fn)
        if not inspect.isfunction(func):
            raise TypeError(f"a {type(func).__name__} in the forward chain")
        parts = [f"{func.__module__}.{func.__qualname__}", _sha(_own_source(func))[:16]]
        for cell in func.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, (int, float, str, bool, type(None))):
                parts.append(repr(value))
            elif inspect.isfunction(value) and value is not getattr(func, "__wrapped__", None):
                parts.append(f"{value.__qualname__}={_sha(_own_source(value))[:16]}")
        out.append(":".join(parts))
        fn = getattr(func, "__wrapped__", None)
    return out


def _loss_objects():
    from transformers.loss import loss_utils

    return loss_utils.LOSS_MAPPING.get("ForCausalLM"), loss_utils.ForCausalLMLoss


def _memo_key(cls: type, spec, config=None):
    from .live_config import fingerprint
    from .registry import stock_forward_of

    facts = None if config is None else (fingerprint(config) or ("unhashable", id(config)))
    return (cls, getattr(spec, "fingerprint", spec.source_hash), stock_forward_of(cls.forward),
            *_loss_objects(), facts)


def _versions() -> dict:
    import transformers

    return {"python": list(sys.version_info[:2]), "torch": str(torch.__version__),
            "transformers": transformers.__version__}


def disk_key(cls: type, spec, model_type: str | None, config=None) -> str | None:
    """The file name (sha256) of ``cls``'s proof on disk, or None when some input has no source.

    Covers the Python, torch and transformers versions, the class's module file, each function
    of its forward chain, the spec's fingerprint, the model type, the source of the causal-LM
    loss in force (``LOSS_MAPPING["ForCausalLM"]``, ``ForCausalLMLoss``,
    ``fixed_cross_entropy``), this package's own fused-path sources and, for an instance's
    proof, the fingerprint of its ``config`` (:func:`~.live_config.fingerprint`).
    """
    from transformers.loss import loss_utils

    from .live_config import fingerprint

    facts = fingerprint(config) if config is not None else None
    if config is not None and facts is None:
        return None

    try:
        module_file = Path(sys.modules[cls.__module__].__file__).read_bytes()
        loss_sources = [inspect.getsource(f) for f in (*_loss_objects(),
                                                       loss_utils.fixed_cross_entropy)]
        chain = _forward_chain(cls)
        package = Path(__file__).resolve().parents[1]
        own = [_sha((package / rel).read_bytes()) for rel in _OWN_SOURCES]
    except (OSError, TypeError, KeyError, AttributeError, ValueError):
        return None
    material = {
        "format": PROOF_FORMAT,
        **_versions(),
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "module_file": _sha(module_file),
        "model_type": model_type,
        "fingerprint": getattr(spec, "fingerprint", spec.source_hash),
        "forward_chain": chain,
        "loss": [_sha(s) for s in loss_sources],
        "own": own,
        "config": facts,
    }
    return _sha(json.dumps(material, sort_keys=True))


def _read_disk(key: str) -> dict | None:
    try:
        row = json.loads((cache_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(row, dict) or row.get("key") != key or row.get("status") != "pass":
        return None  # corrupt, foreign or not a pass
    return row


def _write_disk(key: str, row: dict) -> None:
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".proof-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({**row, "key": key}, f)
        os.replace(tmp, folder / f"{key}.json")  # atomic: readers see all or nothing
    except OSError:
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)  # noqa: F821 - bound when mkstemp succeeded


# -- the gate ------------------------------------------------------------------------------------


def ensure_proven(cls: type, spec, model_type: str | None = None, device=None,
                  config=None) -> None:
    """Prove ``cls`` on this machine (or find the proof cached), or refuse it.

    Args:
        cls: the causal-LM class about to be patched.
        spec: its derived :class:`~fused_ce_patch.hf.architectures.ArchSpec`.
        model_type: the model's ``config.model_type`` (None: the class config's).
        device: the model's device: where the proof runs again if the tiny stock model cannot
            run on the CPU (:func:`prove`); None: the CPU only.
        config: the model's ``config``: the proof's model is built from it (:func:`prove`);
            None (a class-level patch): from the class's default config.

    Raises:
        UnsupportedModelError: the patched copy differs from the stock forward (the numbers in
            the message), or no tiny model of the class could be built or run (the reason; then
            ``FUSED_CE_ALLOW_UNVERIFIED=1`` patches anyway, with one warning). A proven
            difference is refused whatever the environment says.

    Takes about 0.1-0.6 s for a text model the first time per process and cache key (seconds
    for some multimodal ones); later calls read the memo or the disk cache (~0.02 s).
    """
    from .verified import ALLOW_ENV, allow_unverified

    memo_key = _memo_key(cls, spec, config)
    row = _MEMO.get(memo_key)
    if row is not None and _stock_failed(row) and "device" not in row and \
            _retry_device(device) is not None:
        row = None  # refused on the CPU alone; the model's device may run the stock forward
    if row is None:
        key = disk_key(cls, spec, model_type, config)
        row = _read_disk(key) if key is not None else None
        context = []
        if row is None:
            context = caller_context()
            row = prove(cls, spec, model_type, device, config)
            if row["status"] == "pass" and key is not None:
                _write_disk(key, row)
        if row["status"] == "pass" or not context:
            # The proof sets the caller's context aside; a refusal seen inside one is still
            # not remembered, so a later call outside it proves again.
            _MEMO[memo_key] = row
    if row["status"] == "pass":
        return
    what = f"{cls.__name__} (model_type {model_type!r})" if model_type else cls.__name__
    if row["status"] == "fail":
        raise UnsupportedModelError(
            f"fused_ce_patch cannot patch {what}: the patched forward does not reproduce the "
            f"installed stock forward on a tiny {cls.__name__} ({row['reason']}), so it would "
            f"change your numbers. {SUPPORT_TABLE}."
        )
    reason = {
        "unbuildable": "could not check the patched forward against the stock one",
        "unsupported": "the patch does not fit this class",
        "error": "the patched forward failed on a tiny model of this class",
    }[row["status"]]
    if row["status"] == "unsupported":
        raise UnsupportedModelError(
            f"fused_ce_patch cannot patch {what}: {reason} ({row.get('reason')}). "
            f"{SUPPORT_TABLE}."
        )
    if allow_unverified():
        if not row.get("warned"):
            row["warned"] = True
            logger.warning("fused_ce_patch: patching %s unproven (%s=1): %s: %s", what,
                           ALLOW_ENV, reason, row.get("reason"))
        return
    raise UnsupportedModelError(
        f"fused_ce_patch cannot patch {what}: {reason} ({row.get('reason')}). "
        f"{SUPPORT_TABLE}; {ALLOW_ENV}=1 patches a class that could not be checked, at your "
        f"own risk."
    )

"""The per-call checks after their host-time trims (issue 39, item 3) keep their semantics.

The fast paths are exact rewrites, not caches: ``kwargs.get("labels")`` only where
``signature.bind`` provably binds the same value; attribute reads of loaded modules where an
import statement read them; early exits where nothing is registered. So a change made between
two calls of one patched model (a hook, a process-wide hook, a replaced head, the environment
variable, the class's forward) is still seen by the very next call — checked here call after
call on one model, each time with a spy showing which path ran.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import warnings

import pytest
import torch

from fused_ce_patch import apply_fused_ce
from fused_ce_patch.hf import head as hf_head
from fused_ce_patch.hf.forward import keyword_labels_bind
from fused_ce_patch.hf.sentinel import NotMaterializedLogits
from hf_helpers import batch, build_model

P = inspect.Parameter


def _signature(*params):
    return inspect.Signature(list(params))


SELF = P("self", P.POSITIONAL_OR_KEYWORD)
LABELS = P("labels", P.POSITIONAL_OR_KEYWORD, default=None)
IDS = P("input_ids", P.POSITIONAL_OR_KEYWORD, default=None)
KWARGS = P("kwargs", P.VAR_KEYWORD)

#: Signatures the fast path must accept (first) or refuse (rest), and why.
ACCEPTED = {
    "stock-like": _signature(SELF, IDS, LABELS, KWARGS),
    "labels keyword-only": _signature(SELF, IDS, P("args", P.VAR_POSITIONAL),
                                      P("labels", P.KEYWORD_ONLY, default=None), KWARGS),
    "positional-only self": _signature(P("self", P.POSITIONAL_ONLY), LABELS, KWARGS),
}
REFUSED = {
    "labels only in **kwargs": _signature(SELF, IDS, KWARGS),
    "no **kwargs": _signature(SELF, IDS, LABELS),
    "a required parameter": _signature(SELF, P("input_ids", P.POSITIONAL_OR_KEYWORD), LABELS,
                                       KWARGS),
    "a required keyword-only parameter": _signature(SELF, LABELS, P("x", P.KEYWORD_ONLY),
                                                    KWARGS),
    "first parameter not self": _signature(P("model", P.POSITIONAL_OR_KEYWORD), LABELS, KWARGS),
    "labels positional-only": _signature(P("self", P.POSITIONAL_ONLY),
                                         P("labels", P.POSITIONAL_ONLY, default=None), KWARGS),
    "no parameters": _signature(),
    "only **kwargs": _signature(KWARGS),
}

#: Keyword sets a ``forward(self, *args, **kwargs)`` wrapper can receive (never ``self``).
KEYWORDS = ("labels", "input_ids", "x", "model", "args", "kwargs", "other")


def _bound_labels(signature, kwargs):
    try:
        return "ok", signature.bind(object(), **kwargs).arguments.get("labels")
    except TypeError as exc:
        return "TypeError", str(exc)


@pytest.mark.parametrize("name", list(ACCEPTED) + list(REFUSED))
def test_keyword_labels_fast_path_is_bind_exactly(name):
    """Where the fast path is taken, ``kwargs.get("labels")`` equals what ``bind`` binds, for
    every subset of keywords (bind never raises there); the refused signatures each have a
    keyword set on which the two differ or bind raises — the reason they are refused."""
    signature = {**ACCEPTED, **REFUSED}[name]
    assert keyword_labels_bind(signature) is (name in ACCEPTED)
    differs = False
    for r in range(len(KEYWORDS) + 1):
        for names in itertools.combinations(KEYWORDS, r):
            kwargs = {k: object() for k in names}
            status, got = _bound_labels(signature, kwargs)
            same = status == "ok" and got is kwargs.get("labels")
            if name in ACCEPTED:
                assert same, (names, status, got)
            differs |= not same
    if name in REFUSED:
        assert differs


def test_stock_forward_signature_takes_the_fast_path():
    from fused_ce_patch.hf.registry import stock_forward_of
    from transformers import LlamaForCausalLM

    stock = stock_forward_of(LlamaForCausalLM.forward)
    assert keyword_labels_bind(inspect.signature(stock))


@pytest.fixture
def llama():
    return apply_fused_ce(build_model("llama"), backend="torch")


def _fused(model, spy, **kw):
    """One forward with labels; whether it took the fused path (spy and sentinel agree)."""
    before = spy.count
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = model(**batch(), **kw)
    fused = spy.count == before + 1
    assert isinstance(out.logits, NotMaterializedLogits) is fused
    assert torch.isfinite(out.loss)
    return fused


def test_labels_positional_and_keyword_route_the_same(llama, spy):
    kw = batch()
    assert _fused(llama, spy)
    out = llama(kw["input_ids"], kw["attention_mask"], labels=kw["labels"])
    assert spy.count == 2 and isinstance(out.logits, NotMaterializedLogits)
    names = list(inspect.signature(llama.forward).parameters)
    args = [kw.get(n) for n in names[: names.index("labels") + 1]]
    out = llama(*args)  # labels by position: bind finds them
    assert spy.count == 3 and isinstance(out.logits, NotMaterializedLogits)
    out = llama(input_ids=kw["input_ids"])  # no labels: stock
    assert spy.count == 3 and out.loss is None and isinstance(out.logits, torch.Tensor)


def test_skip_logits_without_labels_still_raises(llama):
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        llama(input_ids=batch()["input_ids"], skip_logits=True)


def test_labels_both_positional_and_keyword_raise_as_stock(llama):
    """With positional arguments the labels come from ``bind`` (not the fast path), whose
    ``TypeError`` for ``labels`` given twice is what the stock forward raises too."""
    kw = batch()
    names = list(inspect.signature(llama.forward).parameters)
    args = [kw.get(n) for n in names[: names.index("labels") + 1]]
    with pytest.raises(TypeError, match="labels"):
        build_model("llama")(*args, labels=kw["labels"])  # unpatched
    with pytest.raises(TypeError, match="labels"):
        llama(*args, labels=kw["labels"])


def test_changes_between_calls_are_seen_by_the_next_call(llama, spy, monkeypatch):
    """Each change made between two calls of one model decides the next call; undone, the
    call after it is fused again."""
    head = llama.lm_head
    assert _fused(llama, spy)

    handle = head.register_forward_pre_hook(lambda m, a: None)
    assert not _fused(llama, spy)
    handle.remove()
    assert _fused(llama, spy)

    handle = head.register_forward_hook(lambda m, a, o: None)
    assert not _fused(llama, spy)
    handle.remove()
    assert _fused(llama, spy)

    handle = head.register_full_backward_hook(lambda m, gi, go: None)
    assert not _fused(llama, spy)
    handle.remove()
    assert _fused(llama, spy)

    for register in (torch.nn.modules.module.register_module_forward_pre_hook,
                     torch.nn.modules.module.register_module_forward_hook,
                     torch.nn.modules.module.register_module_full_backward_hook):
        handle = register(lambda *a: None)
        try:
            assert not _fused(llama, spy), register.__name__
        finally:
            handle.remove()
        assert _fused(llama, spy)

    monkeypatch.setenv("FUSED_CE_RETURN_LOGITS", "1")
    assert not _fused(llama, spy)
    monkeypatch.setenv("FUSED_CE_RETURN_LOGITS", " Off ")
    assert _fused(llama, spy)
    monkeypatch.delenv("FUSED_CE_RETURN_LOGITS")

    class Custom(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    original = llama.lm_head
    replaced = Custom(original.in_features, original.out_features, bias=False)
    replaced.weight = original.weight
    llama.lm_head = replaced
    assert not _fused(llama, spy)
    llama.lm_head = original
    assert _fused(llama, spy)

    with monkeypatch.context() as mp:  # (monkeypatch.undo() would undo the spy too)
        mp.setattr(torch.nn.Linear, "forward", lambda self, x: x @ self.weight.T)
        assert not _fused(llama, spy)
    assert _fused(llama, spy)


def test_class_forward_replaced_between_calls(llama, spy, monkeypatch):
    cls = type(llama)
    assert _fused(llama, spy)
    stock = cls.forward
    seen = []

    def wrapped(self, *args, **kwargs):
        seen.append(1)
        return stock(self, *args, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(cls, "forward", wrapped)
        assert not _fused(llama, spy) and seen == [1]
    assert _fused(llama, spy)


def test_loaded_module_classes_are_what_the_imports_give():
    """The attribute-read fast paths return what the import statements return."""
    pytest.importorskip("peft")
    import peft  # noqa: F401  (loads the modules the fast path reads)
    from peft.tuners.lora.layer import Linear
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:
        AuxiliaryTrainingWrapper = ModulesToSaveWrapper
    assert hf_head._peft_classes() == (BaseTunerLayer, AuxiliaryTrainingWrapper,
                                       ModulesToSaveWrapper, Linear)
    from torch.distributed.fsdp import FullyShardedDataParallel

    assert hf_head._fsdp1_class() is FullyShardedDataParallel


def test_peft_classes_import_a_module_not_loaded_yet(monkeypatch):
    """With ``peft`` loaded but a module of the four not (yet) in sys.modules, the import
    statements run (and load it), as before."""
    pytest.importorskip("peft")
    import peft  # noqa: F401
    import peft.tuners.lora.layer as layer

    monkeypatch.delitem(sys.modules, "peft.tuners.lora.layer")
    classes = hf_head._peft_classes()
    assert "peft.tuners.lora.layer" in sys.modules
    assert classes[3].__name__ == "Linear" and classes[3].__module__ == layer.__name__


def test_global_hooks_named_and_tracker_hooks_ignored():
    m = torch.nn.modules.module
    assert hf_head._global_hooks() == ""
    handles = [m.register_module_forward_hook(lambda *a: None),
               m.register_module_full_backward_pre_hook(lambda *a: None)]
    try:
        assert hf_head._global_hooks() == "forward, backward pre-"
    finally:
        for h in handles:
            h.remove()
    from torch.utils.module_tracker import ModuleTracker

    with ModuleTracker():  # its hooks only record which module runs
        assert hf_head._global_hooks() == ""


def test_check_gathered_still_names_the_mode():
    from fused_ce_patch.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"no gathering wrapper found"):
        hf_head._check_gathered(torch.zeros(3), torch.zeros(2, 4), "lm_head", [])


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - compared by type (a tensor's `in` raises)
        return type(exc)


def _reference_parametrized(module, pname="weight"):
    parametrizations = getattr(module, "parametrizations", None)
    return parametrizations is not None and pname in parametrizations


def _modules_with_and_without_the_attribute():
    """(module, whether getattr(module, "parametrizations") finds something)."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    plain = torch.nn.Linear(3, 4)
    param = torch.nn.Linear(3, 4)
    parametrize.register_parametrization(param, "weight", Double())
    in_dict = torch.nn.Linear(3, 4)
    object.__setattr__(in_dict, "parametrizations", {"weight": None})
    as_buffer = torch.nn.Linear(3, 4)
    as_buffer.register_buffer("parametrizations", torch.zeros(1))
    as_module = torch.nn.Linear(3, 4)
    as_module.parametrizations = torch.nn.ModuleDict({"bias": torch.nn.Identity()})

    class ClassAttr(torch.nn.Linear):
        parametrizations = {"weight": None}

    class Property(torch.nn.Linear):
        @property
        def parametrizations(self):
            return {"weight": None}

    class OwnGetattr(torch.nn.Linear):
        def __getattr__(self, name):
            if name == "parametrizations":
                return {"weight": None}
            return super().__getattr__(name)

    class OwnGetattribute(torch.nn.Linear):
        def __getattribute__(self, name):
            if name == "parametrizations":
                return {"weight": None}
            return super().__getattribute__(name)

    return [(plain, False), (param, True), (in_dict, True), (as_buffer, True),
            (as_module, True), (ClassAttr(3, 4), True), (Property(3, 4), True),
            (OwnGetattr(3, 4), True), (OwnGetattribute(3, 4), True)]


def test_module_lacks_only_when_getattr_finds_nothing():
    """``_module_lacks`` (the cheap test before ``getattr`` in :func:`parametrized`) is True only
    where ``getattr`` raises, so ``parametrized`` answers as the plain ``getattr`` does, for
    attributes in every place Python and ``nn.Module`` look."""
    cases = _modules_with_and_without_the_attribute()
    for module, found in cases:
        lacks = hf_head._module_lacks(module, "parametrizations")
        assert not (lacks and found), type(module).__name__
        assert hasattr(module, "parametrizations") is found
        for pname in ("weight", "bias"):
            assert _outcome(hf_head.parametrized, module, pname) == \
                _outcome(_reference_parametrized, module, pname), type(module).__name__
    assert hf_head._module_lacks(cases[0][0], "parametrizations")  # the fast path is taken


def test_parametrization_added_between_calls_is_seen(llama, spy):
    """A weight parametrized after the patch is seen at the next call: that call still runs
    (whichever path), the one after the parametrization is removed is fused."""
    from torch.nn.utils import parametrize

    class Same(torch.nn.Module):
        def forward(self, w):
            return w

    assert _fused(llama, spy)
    assert not hf_head.parametrized(llama.lm_head)
    parametrize.register_parametrization(llama.lm_head, "weight", Same())
    assert hf_head.parametrized(llama.lm_head)
    _fused(llama, spy)
    parametrize.remove_parametrizations(llama.lm_head, "weight")
    assert not hf_head.parametrized(llama.lm_head)
    assert _fused(llama, spy)

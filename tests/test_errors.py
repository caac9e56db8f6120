"""docs/design.md §3 errors, option validation, and the backend registry (docs/design.md §4).

NaN/inf propagation is part of the per-backend suite (``tests/backends/semantics.py``,
``test_nonfinite_inputs_propagate``), so it runs on every backend.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

from fused_ce_patch import BackendUnavailableError, FusedLinearCrossEntropyLoss
from fused_ce_patch import fused_linear_cross_entropy as flce
from fused_ce_patch.backends import Backend, registry
from fused_ce_patch.backends.torch_chunked import TorchBackend

pytestmark = pytest.mark.usefixtures("seed", "one_thread")

V, H = 11, 8


def _inputs(lead=(2, 3), dtype=torch.float32):
    hidden = torch.randn(*lead, H, dtype=dtype)
    weight = torch.randn(V, H, dtype=dtype)
    labels = torch.randint(0, V, lead)
    return hidden, weight, labels


# -- labels ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [V, V + 1000, -1, -99, -101])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_label_out_of_range_names_value_and_vocab(bad, backend):
    hidden, weight, labels = _inputs()
    labels[1, 2] = bad
    with pytest.raises(ValueError) as err:
        flce(hidden, weight, labels, backend=backend)
    msg = str(err.value)
    assert re.search(rf"(?<![\d-]){bad}(?!\d)", msg), msg
    assert f"V = {V}" in msg


def test_ignored_and_shifted_out_labels_are_not_checked():
    hidden, weight, labels = _inputs()
    labels[0, 0] = 7777  # never a target under shift=True: position -1 would predict it
    flce(hidden, weight, labels, shift=True)
    labels[0, 0] = V + 3  # the ignore index itself may lie anywhere, even inside [0, V)
    flce(hidden, weight, labels, ignore_index=V + 3)
    labels[0, 0] = 4
    flce(hidden, weight, labels, ignore_index=4)
    with pytest.raises(ValueError, match="7777"):
        labels[1, 1] = 7777
        flce(hidden, weight, labels, shift=True)


def test_labels_must_be_integers():
    hidden, weight, labels = _inputs()
    for bad in (labels.float(), labels.bool()):
        with pytest.raises(TypeError, match="integer"):
            flce(hidden, weight, bad)
    flce(hidden, weight, labels.int())  # int32 is accepted


# -- shapes ---------------------------------------------------------------------------------


def test_leading_shape_mismatch_names_both_shapes():
    hidden, weight, _ = _inputs((2, 3))
    labels = torch.randint(0, V, (2, 4))
    with pytest.raises(ValueError) as err:
        flce(hidden, weight, labels)
    assert "(2, 4)" in str(err.value) and f"(2, 3, {H})" in str(err.value)
    with pytest.raises(ValueError, match=r"\(6,\)"):
        flce(hidden, weight, labels.new_zeros(6))


def test_weight_shape_errors_name_both_shapes():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match=rf"\(1, {V}, {H}\)"):
        flce(hidden, weight.unsqueeze(0), labels)
    wrong_h = torch.randn(V, H + 1)
    with pytest.raises(ValueError) as err:
        flce(hidden, wrong_h, labels)
    assert f"(2, 3, {H})" in str(err.value) and f"({V}, {H + 1})" in str(err.value)
    with pytest.raises(ValueError) as err:
        flce(hidden, weight, labels, bias=torch.randn(V + 1))
    assert f"({V + 1},)" in str(err.value) and f"({V}, {H})" in str(err.value)


# -- dtypes and devices ---------------------------------------------------------------------


def test_dtype_mismatch_is_a_type_error():
    hidden, weight, labels = _inputs()
    with pytest.raises(TypeError, match="bfloat16"):
        flce(hidden, weight.bfloat16(), labels)
    with pytest.raises(TypeError, match="float16"):
        flce(hidden.half(), weight, labels)
    with pytest.raises(TypeError, match="bias"):
        flce(hidden, weight, labels, bias=torch.randn(V, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating point"):
        flce(hidden.long(), weight.long(), labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the documented cast, as lm_head
        assert flce(hidden, weight.bfloat16(), labels).dtype == torch.float32


def test_device_mismatch():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="meta"):
        flce(hidden, weight, labels.to("meta"))


# -- options --------------------------------------------------------------------------------


def test_unknown_reduction_lists_valid_ones():
    hidden, weight, labels = _inputs()
    for call in (
        lambda: flce(hidden, weight, labels, reduction="avg"),
        lambda: FusedLinearCrossEntropyLoss(reduction="avg"),
    ):
        with pytest.raises(ValueError) as err:
            call()
        assert all(r in str(err.value) for r in ("mean", "sum", "none"))


def test_unknown_backend_lists_valid_ones():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError) as err:
        flce(hidden, weight, labels, backend="cuda")
    assert all(b in str(err.value) for b in ("auto", "triton", "ascend", "torch", "reference"))


@pytest.mark.parametrize(
    "kw,exc",
    [
        ({"softcap": 0.0}, ValueError),
        ({"softcap": -30.0}, ValueError),
        ({"label_smoothing": -0.1}, ValueError),
        ({"label_smoothing": 1.5}, ValueError),
        ({"z_loss": -1e-4}, ValueError),
        ({"z_loss": float("nan")}, ValueError),
        ({"z_loss": float("inf")}, ValueError),
        ({"softcap": float("inf")}, ValueError),
        ({"logits_budget": -1}, ValueError),
        ({"logits_budget": 1.5}, TypeError),
        ({"logits_budget": True}, TypeError),
        ({"num_items_in_batch": 4, "reduction": "none"}, ValueError),
        ({"num_items_in_batch": "4"}, TypeError),
        ({"num_items_in_batch": True}, TypeError),
        # Issue 9 item 4: booleans are refused for every numeric option (softcap=True used to
        # mean 1.0), and ignore_index must be an int on every backend.
        ({"softcap": True}, TypeError),
        ({"softcap": "30"}, TypeError),
        ({"label_smoothing": True}, TypeError),
        ({"z_loss": True}, TypeError),
        ({"ignore_index": True}, TypeError),
        ({"ignore_index": -100.5}, TypeError),
        ({"ignore_index": -100.0}, TypeError),
        ({"ignore_index": torch.tensor(-100)}, TypeError),
        ({"num_items_in_batch": torch.tensor([3, 4])}, ValueError),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
def test_option_out_of_range(kw, exc, backend, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the check comes before any kernel runs
    hidden, weight, labels = _inputs()
    with pytest.raises(exc):
        flce(hidden, weight, labels, backend=backend, **kw)


def test_module_refuses_bad_option_types_at_construction():
    for kw in ({"softcap": True}, {"ignore_index": -100.5}, {"logits_budget": False}):
        with pytest.raises(TypeError):
            FusedLinearCrossEntropyLoss(**kw)


def test_numpy_numbers_are_accepted():
    np = pytest.importorskip("numpy")
    hidden, weight, labels = _inputs()
    want = flce(hidden, weight, labels, softcap=3.0, ignore_index=-100, num_items_in_batch=5)
    got = flce(hidden, weight, labels, softcap=np.float32(3.0), ignore_index=np.int64(-100),
               num_items_in_batch=np.int64(5))
    torch.testing.assert_close(got, want)


def test_meta_tensors_raise_a_clear_error_under_autocast_and_without():
    # Regression (issue 9 item 4): autocast's device check raised an unrelated RuntimeError.
    hidden, weight, labels = (t.to("meta") for t in _inputs())
    with pytest.raises(ValueError, match="meta tensor"):
        flce(hidden, weight, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="meta"):
        flce(hidden, weight, labels)
    real = _inputs()
    with pytest.raises(ValueError, match="labels is a meta tensor"):
        flce(real[0], real[1], labels)


# -- backend registry -----------------------------------------------------------------------


class FakeBackend(Backend):
    """A backend that claims the CPU but cannot run (its kernels are "missing")."""

    name = "fake"
    priority = 100
    device_types = ("cpu",)

    def availability(self):
        return False, "fake kernels are not installed"

    def accepts(self, device, dtype):
        return True, ""

    def run(self, problem):
        raise AssertionError("an unavailable backend ran")


class PickyBackend(TorchBackend):
    """Available, high priority, but only for float16 on CPU."""

    name = "picky"
    priority = 50
    device_types = ("cpu",)
    calls = 0

    def accepts(self, device, dtype):
        if dtype != torch.float16:
            return False, "float16 only"
        return True, ""

    def run(self, problem):
        PickyBackend.calls += 1
        return super().run(problem)


@pytest.fixture
def clean_registry(monkeypatch):
    """Registry edits and the warned-once memory are restored after the test."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_warned", set())
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    return registry


@pytest.fixture
def spy_runs(monkeypatch):
    """Names of the backends whose ``run`` was called, in order."""
    calls = []
    for backend in list(registry._REGISTRY.values()):
        original = backend.run

        def run(problem, _original=original, _name=backend.name):
            calls.append(_name)
            return _original(problem)

        monkeypatch.setattr(backend, "run", run)
    return calls


def test_auto_picks_torch_on_cpu(clean_registry, spy_runs):
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert registry.resolve("auto", cpu, dtype).name == "torch"
    hidden, weight, labels = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flce(hidden, weight, labels)
    assert spy_runs == ["torch"]


def test_auto_ignores_the_triton_interpreter_for_cpu_tensors(clean_registry, spy_runs,
                                                             monkeypatch):
    # Regression (issue 9 item 4): with TRITON_INTERPRET=1 in the environment "auto" picked the
    # (slow) Triton interpreter for CPU tensors. An explicit backend="triton" still uses it.
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    assert registry.resolve("auto", cpu, torch.float32).name == "torch"
    hidden, weight, labels = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no fallback warning: nothing was passed over
        flce(hidden, weight, labels)
    assert spy_runs == ["torch"]
    # (Running the kernels needs TRITON_INTERPRET set before triton is imported: that is
    # tests/backends/test_triton.py's job; here, the explicit choice still resolves.)
    assert registry.resolve("triton", cpu, torch.float32).name == "triton"


def test_env_var_overrides_auto(clean_registry, spy_runs, monkeypatch):
    hidden, weight, labels = _inputs()
    monkeypatch.setenv("FUSED_CE_BACKEND", "reference")
    flce(hidden, weight, labels)
    flce(hidden, weight, labels, backend="torch")  # an explicit choice is not overridden
    assert spy_runs == ["reference", "torch"]
    monkeypatch.setenv("FUSED_CE_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="nonsense.*torch"):
        flce(hidden, weight, labels)
    monkeypatch.setenv("FUSED_CE_BACKEND", "fake")
    clean_registry.register(FakeBackend())
    with pytest.raises(BackendUnavailableError, match="FUSED_CE_BACKEND"):
        flce(hidden, weight, labels)


def test_explicit_backend_that_cannot_run_raises(clean_registry):
    hidden, weight, labels = _inputs()
    clean_registry.register(FakeBackend())
    with pytest.raises(BackendUnavailableError, match="fake kernels are not installed"):
        flce(hidden, weight, labels, backend="fake")
    clean_registry.register(PickyBackend())
    with pytest.raises(BackendUnavailableError, match="float16 only"):
        flce(hidden, weight, labels, backend="picky")
    # a name of docs/design.md §2 whose module did not register (here: removed for the test)
    clean_registry._REGISTRY.pop("triton", None)
    with pytest.raises(BackendUnavailableError, match="triton"):
        flce(hidden, weight, labels, backend="triton")


def test_auto_falls_back_and_warns_once(clean_registry, spy_runs):
    hidden, weight, labels = _inputs()
    clean_registry.register(FakeBackend())
    with pytest.warns(RuntimeWarning, match="'fake'.*not installed.*'torch'"):
        flce(hidden, weight, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flce(hidden, weight, labels)  # second time: silent
    assert spy_runs == ["torch", "torch"]


def test_auto_checks_the_call(clean_registry):
    clean_registry.register(PickyBackend())
    hidden, weight, labels = _inputs()
    PickyBackend.calls = 0
    with pytest.warns(RuntimeWarning, match="float16 only"):
        flce(hidden, weight, labels)
    flce(hidden.half(), weight.half(), labels)
    assert PickyBackend.calls == 1
    rows = clean_registry.explain(torch.device("cpu"), torch.float32)
    assert ("picky", False, "float16 only") in rows
    assert ("torch", True, "") in rows


def test_registering_needs_a_name(clean_registry):
    with pytest.raises(ValueError):
        clean_registry.register(Backend())


def test_empty_hidden_or_vocab_dimension_is_a_clear_error():
    labels = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"H >= 1.*\(5, 0\)"):
        flce(torch.randn(3, 0), torch.randn(5, 0), labels)
    with pytest.raises(ValueError, match=r"V >= 1.*\(0, 4\)"):
        flce(torch.randn(3, 4), torch.randn(0, 4), labels)


@pytest.mark.parametrize("backend", ["torch"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_double_backward_is_refused_not_silently_detached(backend, reduction):
    hidden = torch.randn(5, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    loss = flce(hidden, weight, torch.randint(0, V, (5,)), reduction=reduction, backend=backend)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss.sum(), hidden, create_graph=True)


def test_num_items_in_batch_divides_exactly_for_every_value():
    hidden, weight, labels = _inputs()
    total = flce(hidden, weight, labels, reduction="sum")
    # A Python float too (issue 9 item 4), as transformers' ForCausalLMLoss accepts.
    for n in (torch.tensor(0.5), 3, torch.tensor(7.25, dtype=torch.float64), 7.25, 3.0):
        got = flce(hidden, weight, labels, num_items_in_batch=n)
        torch.testing.assert_close(got, total / float(n), rtol=1e-6, atol=0)
    # stock's sum / n for every n (tests/backends/semantics.py checks gradients too)
    for n in (0, torch.tensor(0), 0.0):
        assert flce(hidden, weight, labels, num_items_in_batch=n) == math.inf
    torch.testing.assert_close(flce(hidden, weight, labels, num_items_in_batch=-2), -total / 2)

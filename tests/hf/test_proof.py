"""The proof of the live model (hf/proof.py): what it accepts, refuses, caches, and leaves alone.

A class is patched only when a tiny model of it, stock against a patched copy, gives the same
loss and gradients here and now. These tests prove that a release we never saw is patched, a
divergence is refused with its numbers, the caches hold exactly what they should, and the proof
leaves no trace in the caller's process.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import re
import sys

import pytest
import torch
import transformers
from transformers.loss import loss_utils

from fused_ce_patch import (
    UnsupportedModelError,
    apply_fused_ce,
    apply_fused_ce_to_class,
    revert_fused_ce,
)
from fused_ce_patch.hf import head as hf_head
from fused_ce_patch.hf import proof, sweep, tiny, verified
from fused_ce_patch.hf.architectures import derive_spec
from fused_ce_patch.hf.patch import spec_for_class
from fused_ce_patch.hf.sentinel import NotMaterializedLogits

LLAMA = "transformers.models.llama.modeling_llama"


pytestmark = pytest.mark.usefixtures("fresh_proofs")  # tests/hf/conftest.py


@pytest.fixture
def next_release(tmp_path):
    """``modeling_llama`` as a release we never saw: its LlamaForCausalLM.forward source
    differs (one comment line), so its source hash is one no record has ever held."""
    source = inspect.getsource(importlib.import_module(LLAMA))
    marker = "        outputs: BaseModelOutputWithPast = self.model("
    assert source.count(marker) == 1, "modeling_llama changed shape: adapt the fixture"
    source = source.replace(marker, "        # a comment a later release added\n" + marker)
    path = tmp_path / "modeling_llama_next.py"
    path.write_text(source)
    name = "transformers.models.llama._fused_ce_test_next"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


@pytest.fixture
def prove_calls(monkeypatch):
    calls = []
    real = proof.prove

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(proof, "prove", counting)
    return calls


def _tiny(cls, model_type="llama"):
    torch.manual_seed(0)
    config = sweep.tiny_config(model_type)
    return cls(config).train(), sweep._batches(config, torch)["padded"]


def test_a_release_never_seen_is_proven_and_patched(next_release, prove_calls, spy):
    cls = next_release.LlamaForCausalLM
    assert cls is not transformers.LlamaForCausalLM
    assert derive_spec(cls).source_hash != derive_spec(transformers.LlamaForCausalLM).source_hash
    model, batch = _tiny(cls)
    stock = model(**batch).loss  # before the patch: the number to keep
    apply_fused_ce(model, backend="torch")
    assert prove_calls == [cls]
    spy.calls.clear()
    out = model(**batch)
    assert spy.count == 1 and isinstance(out.logits, NotMaterializedLogits)
    assert torch.allclose(out.loss, stock, rtol=1e-5, atol=0)


def test_proof_runs_in_float64_and_reports(next_release):
    cls = next_release.LlamaForCausalLM
    row = proof.prove(cls, derive_spec(cls), "llama")
    assert row["status"] == "pass" and row["dtype"] == "float64", row
    loss_tol, grad_tol = proof.TOLERANCES[torch.float64]
    assert row["loss_rel_err"] <= loss_tol and row["grad_rel_err"] <= grad_tol


def test_a_small_divergence_is_refused_with_the_numbers(next_release, monkeypatch):
    """A fused loss off by 3e-6 relative (inside float32's 1e-5, outside float64's 1e-6)."""
    real = hf_head.fused_linear_cross_entropy
    monkeypatch.setattr(hf_head, "fused_linear_cross_entropy",
                        lambda *a, **k: real(*a, **k) * (1 + 3e-6))
    model, _ = _tiny(next_release.LlamaForCausalLM)
    with pytest.raises(UnsupportedModelError) as info:
        apply_fused_ce(model, backend="torch")
    msg = str(info.value)
    assert "float64 padded: loss" in msg and "vs stock" in msg
    assert re.search(r"relative error [2-3]\.\d\de-06, tolerance 1e-06", msg), msg
    assert "\n" not in msg and len(msg) < 600 and "sweep" not in msg, msg
    assert "docs/support.md" in msg
    assert not any(proof.cache_dir().glob("*.json"))  # a failure is not cached
    monkeypatch.setenv(verified.ALLOW_ENV, "1")  # a proven difference is refused regardless
    with pytest.raises(UnsupportedModelError, match="vs stock"):
        apply_fused_ce(model, backend="torch")


def test_a_loss_with_label_smoothing_in_force_is_refused(monkeypatch):
    """ForCausalLMLoss replaced the way transformers ships it (issue 21, finding 3)."""
    stock_loss = loss_utils.ForCausalLMLoss

    def smoothed(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                 shift_labels=None, **kwargs):
        logits = logits.float()
        if shift_labels is None:
            labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        per = torch.nn.functional.cross_entropy(
            logits.view(-1, vocab_size), shift_labels.view(-1).to(logits.device),
            ignore_index=ignore_index, label_smoothing=0.1, reduction="sum")
        n = num_items_in_batch if num_items_in_batch is not None else (
            shift_labels != ignore_index).sum()
        return per / n

    monkeypatch.setattr(loss_utils, "ForCausalLMLoss", smoothed)
    monkeypatch.setitem(loss_utils.LOSS_MAPPING, "ForCausalLM", smoothed)
    try:
        model, batch = _tiny(transformers.LlamaForCausalLM)
        want = model(**batch).loss
        assert not torch.allclose(want, stock_loss(model(**batch).logits, batch["labels"],
                                                   1000))
        try:
            apply_fused_ce(model, backend="torch")
        except UnsupportedModelError as exc:
            assert "cannot patch LlamaForCausalLM" in str(exc)
        else:  # if a future fused path honours it, it must give the same number
            assert torch.allclose(model(**batch).loss, want, rtol=1e-5)
    finally:
        revert_fused_ce()
        monkeypatch.undo()  # before the suite's check that LOSS_MAPPING is unchanged


def test_a_wrapped_class_forward_gives_stock_numbers_or_is_refused(next_release, monkeypatch):
    """A ``functools.wraps`` wrapper doubling the loss (issue 21, finding 1): never a third
    number."""
    cls = next_release.LlamaForCausalLM
    inner = cls.forward

    @functools.wraps(inner)
    def doubled(self, *args, **kwargs):
        out = inner(self, *args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss * 2
        return out

    monkeypatch.setattr(cls, "forward", doubled)
    model, batch = _tiny(cls)
    want = model(**batch).loss
    try:
        apply_fused_ce(model, backend="torch")
    except UnsupportedModelError as exc:
        assert "vs stock" in str(exc) or "did not run" in str(exc), exc
    else:
        assert torch.allclose(model(**batch).loss, want, rtol=1e-5)


def test_cache_written_reused_and_keyed(next_release, prove_calls, monkeypatch):
    cls = next_release.LlamaForCausalLM
    spec = spec_for_class(cls, "llama", check_verified=False)
    proof.ensure_proven(cls, spec, "llama")
    files = list(proof.cache_dir().glob("*.json"))
    assert len(prove_calls) == 1 and len(files) == 1
    assert proof.cache_dir().parent.name == "cache"  # under $FUSED_CE_CACHE_DIR
    assert files[0].stem == proof.disk_key(cls, spec, "llama")
    proof.ensure_proven(cls, spec, "llama")  # the memo
    proof.clear_memo()  # a fresh process: the disk
    proof.ensure_proven(cls, spec, "llama")
    assert len(prove_calls) == 1
    # a corrupt file is ignored (and replaced)
    files[0].write_text("{not json")
    proof.clear_memo()
    proof.ensure_proven(cls, spec, "llama")
    assert len(prove_calls) == 2 and proof._read_disk(files[0].stem) is not None
    # any key input changes the key: another transformers, another loss in force
    real = proof._versions()
    monkeypatch.setattr(proof, "_versions", lambda: {**real, "transformers": "99.0.0"})
    assert proof.disk_key(cls, spec, "llama") != files[0].stem
    proof.clear_memo()
    proof.ensure_proven(cls, spec, "llama")
    assert len(prove_calls) == 3


def test_cache_key_covers_the_loss_and_a_wrapper(next_release, monkeypatch):
    cls = next_release.LlamaForCausalLM
    spec = derive_spec(cls)
    base = proof.disk_key(cls, spec, "llama")
    assert base is not None and proof.disk_key(cls, spec, "llama") == base

    def other_loss(*args, **kwargs):
        return loss_utils.ForCausalLMLoss(*args, **kwargs)

    monkeypatch.setitem(loss_utils.LOSS_MAPPING, "ForCausalLM", other_loss)
    assert proof.disk_key(cls, spec, "llama") != base
    monkeypatch.undo()
    inner = cls.forward

    @functools.wraps(inner)
    def wrapped(self, *args, **kwargs):
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", wrapped)
    assert proof.disk_key(cls, spec, "llama") not in (None, base)
    monkeypatch.setattr(cls, "forward", lambda self, *a, **k: inner(self, *a, **k))
    assert proof.disk_key(cls, spec, "llama") not in (None, base)  # lambdas have source too


def test_unwritable_cache_dir_still_patches(next_release, monkeypatch, tmp_path, prove_calls):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(proof.CACHE_ENV, str(blocker))  # <file>/proofs cannot be created
    model, _ = _tiny(next_release.LlamaForCausalLM)
    apply_fused_ce(model, backend="torch")
    assert len(prove_calls) == 1 and blocker.is_file()


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(proof.CACHE_ENV)
    monkeypatch.delenv("FUSED_CE_PATCH_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert proof.cache_dir() == tmp_path / "xdg" / "fused_ce_patch" / "proofs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert proof.cache_dir().parent.name == "fused_ce_patch"
    assert "site-packages" not in str(proof.cache_dir())


def test_no_side_effects(next_release):
    """RNG not consumed, grad mode / default dtype / log levels / warning filters unchanged,
    nothing left patched."""
    import warnings

    from transformers.utils import logging as hf_logging

    from fused_ce_patch.hf import patch

    cls = next_release.LlamaForCausalLM
    spec = derive_spec(cls)
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    filters = list(warnings.filters)
    verbosity = hf_logging.get_verbosity()
    head_fn = hf_head.fused_linear_cross_entropy
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad(), torch.device("meta"):  # apply_fused_ce may be called anywhere
            proof.ensure_proven(cls, spec, "llama")
            assert not torch.is_grad_enabled() and torch.empty(1).device.type == "meta"
        assert torch.get_default_dtype() is torch.float64
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.equal(torch.get_rng_state(), rng)
    assert warnings.filters == filters and hf_logging.get_verbosity() == verbosity
    assert not logging.getLogger("fused_ce_patch.hf.patch").filters
    assert hf_head.fused_linear_cross_entropy is head_fn
    assert not list(patch._PATCHED_INSTANCES) and cls.forward is inspect.getattr_static(
        cls, "forward")


def test_unbuildable_tiny_model_is_refused_with_the_reason(next_release, monkeypatch, caplog):
    def no_pil(model_type):
        raise ImportError("this model needs PIL")

    monkeypatch.setattr(tiny, "tiny_config", no_pil)
    # nor from the model's own config
    from fused_ce_patch.hf import live_config
    monkeypatch.setattr(live_config, "candidates",
                        lambda cls, config: [("your config", ImportError("this model needs PIL"))])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**tiny._shrink_kwargs(transformers.LlamaConfig, "llama"))
    model = next_release.LlamaForCausalLM(config).train()
    with pytest.raises(UnsupportedModelError) as info:
        apply_fused_ce(model, backend="torch")
    msg = str(info.value)
    assert "could not check" in msg and "ImportError: this model needs PIL" in msg, msg
    assert verified.ALLOW_ENV in msg and "sweep" not in msg
    monkeypatch.setenv(verified.ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="fused_ce_patch.hf.proof"):
        apply_fused_ce(model, backend="torch")
        revert_fused_ce(model)
        apply_fused_ce(model, backend="torch")
    warned = [r for r in caplog.records if "unproven" in r.getMessage()]
    assert len(warned) == 1, caplog.text


def test_a_class_patched_class_is_proven_on_its_stock_path(next_release, prove_calls):
    cls = next_release.LlamaForCausalLM
    apply_fused_ce_to_class(cls, backend="torch")
    try:
        proof.clear_memo()
        row = proof.prove(cls, derive_spec(cls), "llama")
        assert row["status"] == "pass", row
    finally:
        revert_fused_ce(cls)


def test_sweep_and_runtime_share_the_proof(monkeypatch):
    seen = []
    real = proof.prove
    monkeypatch.setattr(proof, "prove", lambda *a, **k: seen.append(a[0]) or real(*a, **k))
    row = sweep.check_type("llama")
    assert row["status"] == "pass" and row["dtype"] == "float64", row
    assert seen == [transformers.LlamaForCausalLM]
    assert not any(proof.cache_dir().glob("*.json"))  # the sweep keeps no cache


@pytest.fixture
def device_only_norm(next_release, monkeypatch):
    """The private release's RMSNorm made a device-only kernel (as Liger's Triton RMSNorm
    patched into a modeling module): it raises on CPU tensors until ``state["on_device"]``."""
    state = {"on_device": False}
    real = next_release.LlamaRMSNorm.forward

    def forward(self, hidden_states):
        if not state["on_device"]:
            raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")
        return real(self, hidden_states)

    monkeypatch.setattr(next_release.LlamaRMSNorm, "forward", forward)
    return state


def test_a_device_only_module_is_proven_on_the_models_device(next_release, device_only_norm,
                                                             monkeypatch):  # fmt: skip
    """The tiny model's stock forward raises on the CPU: the proof runs again on the model's
    device and that result counts. No second device here, so the retry's device is the CPU
    with the kernel "on device" from the second run on; the device moves are no-ops."""
    cls = next_release.LlamaForCausalLM
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**tiny._shrink_kwargs(transformers.LlamaConfig, "llama"))
    model = cls(config).train()
    with pytest.raises(UnsupportedModelError, match="stock forward: ValueError: Pointer"):
        apply_fused_ce(model, backend="torch")  # a CPU model: nowhere else to try
    runs = []
    real_prove_on = proof._prove_on

    def prove_on(cls_, spec, model_type, dev, config=None):
        runs.append(dev)
        device_only_norm["on_device"] = len(runs) > 1
        return real_prove_on(cls_, spec, model_type, dev, config)

    monkeypatch.setattr(proof, "_prove_on", prove_on)
    monkeypatch.setattr(proof, "_retry_device", lambda device: torch.device(device))
    apply_fused_ce(model, backend="torch")  # the memo's CPU-only refusal is not final
    assert len(runs) == 2
    row = proof._MEMO[proof._memo_key(cls, derive_spec(cls), model.config)]
    assert row["status"] == "pass" and row["device"] == "cpu", row
    assert "Pointer argument" in row["cpu_reason"]


def test_a_device_retry_that_differs_is_refused_with_both_reasons(next_release, device_only_norm,
                                                                  monkeypatch):  # fmt: skip
    """On the retry device the stock forward runs but the fused copy is off (the fused loss
    scaled by 1.01): refused with the numbers and the CPU's reason."""
    cls = next_release.LlamaForCausalLM
    real_prove_on = proof._prove_on

    runs = []

    def prove_on(cls_, spec, model_type, dev, config=None):
        runs.append(dev)
        device_only_norm["on_device"] = len(runs) > 1
        return real_prove_on(cls_, spec, model_type, dev, config)
    monkeypatch.setattr(proof, "_prove_on", prove_on)
    real_loss = hf_head.fused_linear_cross_entropy
    monkeypatch.setattr(hf_head, "fused_linear_cross_entropy",
                        lambda *a, **k: real_loss(*a, **k) * 1.01)
    monkeypatch.setattr(proof, "_retry_device", lambda device: torch.device("cpu"))
    row = proof.prove(cls, derive_spec(cls), "llama", device="cpu")
    assert row["status"] == "fail" and row["device"] == "cpu", row
    assert row["reason"].startswith("on cpu: float64 ") and "Pointer argument" in row["reason"]

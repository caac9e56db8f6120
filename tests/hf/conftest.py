"""Fixtures for the Hugging Face integration tests; helpers and tolerances in hf_helpers.py."""

from __future__ import annotations

import pytest

from fused_ce_patch.hf import head as hf_head
from fused_ce_patch.hf import loss_mapping, proof, verified
from hf_helpers import LogitsLossSpy, Spy


@pytest.fixture
def spy(monkeypatch):
    s = Spy(hf_head.fused_linear_cross_entropy)
    monkeypatch.setattr(hf_head, "fused_linear_cross_entropy", s)
    return s


@pytest.fixture
def logits_loss_spy(monkeypatch):
    s = LogitsLossSpy(loss_mapping._LogitsCrossEntropy)
    monkeypatch.setattr(loss_mapping, "_LogitsCrossEntropy", s.cls)
    return s


@pytest.fixture(autouse=True)
def _fresh_stock_path_warnings(monkeypatch):
    """The stock-path warning is once per class and reason and process: each test sees its own."""
    from fused_ce_patch.hf import forward

    monkeypatch.setattr(forward, "_WARNED", set())


@pytest.fixture(autouse=True)
def _clean_patches(monkeypatch):
    """Every test ends with nothing patched; no test may change LOSS_MAPPING at all."""
    import transformers.loss.loss_utils as loss_utils

    from fused_ce_patch import revert_fused_ce

    before = dict(loss_utils.LOSS_MAPPING), loss_utils.ForCausalLMLoss
    monkeypatch.delenv("FUSED_CE_RETURN_LOGITS", raising=False)
    yield
    revert_fused_ce()
    mapping, name = dict(loss_utils.LOSS_MAPPING), loss_utils.ForCausalLMLoss
    assert name is before[1] and mapping.keys() == before[0].keys()
    assert all(mapping[k] is v for k, v in before[0].items())


@pytest.fixture
def fresh_proofs(monkeypatch, tmp_path):
    """A test's own proof cache directory, an empty proof memo, and no opt-in
    (``pytestmark = pytest.mark.usefixtures("fresh_proofs")`` in the proof suites)."""
    monkeypatch.setenv(proof.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(verified.ALLOW_ENV, raising=False)
    proof.clear_memo()
    yield
    proof.clear_memo()

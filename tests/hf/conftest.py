"""Fixtures for the Hugging Face integration tests; helpers and tolerances in hf_helpers.py."""

from __future__ import annotations

import pytest

from fused_ce_patch.hf import head as hf_head
from fused_ce_patch.hf import loss_mapping
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
def _clean_patches(monkeypatch):
    """Every test starts and ends with nothing patched and LOSS_MAPPING pristine."""
    from fused_ce_patch import revert_fused_ce

    monkeypatch.delenv("FUSED_CE_RETURN_LOGITS", raising=False)
    yield
    revert_fused_ce()
    assert not loss_mapping.is_registered()

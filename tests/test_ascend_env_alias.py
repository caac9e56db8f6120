"""``$FUSED_CE_ASCEND_UB_CAPACITY_BITS`` and its deprecated, unprefixed alias."""

from __future__ import annotations

import pytest

from fused_ce_patch.backends.ascend import chip


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in (chip.ENV_UB_BITS, chip.ENV_UB_BITS_DEPRECATED):
        monkeypatch.delenv(name, raising=False)


def test_new_name_sets_the_ub_size():
    assert chip.with_overrides(chip.INTERPRETER).ub_bytes == chip.INTERPRETER.ub_bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSED_CE_ASCEND_UB_CAPACITY_BITS", str(8 * 4096))
        assert chip.with_overrides(chip.INTERPRETER).ub_bytes == 4096


def test_old_name_still_works_and_warns(monkeypatch):
    monkeypatch.setenv("ASCEND_UB_CAPACITY_BITS", str(8 * 8192))
    with pytest.warns(DeprecationWarning, match="FUSED_CE_ASCEND_UB_CAPACITY_BITS"):
        assert chip.with_overrides(chip.INTERPRETER).ub_bytes == 8192


def test_new_name_wins_over_the_old(monkeypatch, recwarn):
    monkeypatch.setenv("ASCEND_UB_CAPACITY_BITS", str(8 * 8192))
    monkeypatch.setenv("FUSED_CE_ASCEND_UB_CAPACITY_BITS", str(8 * 4096))
    assert chip.with_overrides(chip.INTERPRETER).ub_bytes == 4096
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]

"""The test seeds (tests/conftest.py): fixed by default, random only when asked, replayable."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

_here = Path(__file__).with_name("conftest.py")
_spec = importlib.util.spec_from_file_location("root_conftest", _here)
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
seed_for = _conftest.seed_for


def test_default_seed_is_fixed_per_test():
    a = "tests/x.py::test_a[1]"
    assert seed_for(a, None) == seed_for(a, "") == seed_for(a, None)
    assert seed_for(a, None) != seed_for("tests/x.py::test_a[2]", None)


def test_random_seed_is_an_opt_in():
    draws = {seed_for("tests/x.py::test_a", "random") for _ in range(8)}
    assert len(draws) > 1  # 8 draws of 32 bits: equal ones would be a 1-in-2^28 chance
    assert seed_for("tests/x.py::test_a", " Random ") >= 0


def test_an_integer_replays_that_seed():
    assert seed_for("tests/x.py::test_a", "341747593") == 341747593


def test_a_bad_setting_names_the_variable():
    with pytest.raises(ValueError, match="FUSED_CE_TEST_SEED='often'"):
        seed_for("tests/x.py::test_a", "often")


def test_every_test_starts_from_its_seed(seed, request):
    """torch's global RNG is seeded before the test body: the first draw is the seed's."""
    first = torch.rand(3)
    torch.manual_seed(seed)
    assert torch.equal(first, torch.rand(3))
    if not os.environ.get("FUSED_CE_TEST_SEED"):
        assert seed == seed_for(request.node.nodeid, None)

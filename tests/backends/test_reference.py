"""The ``reference`` backend against the float64 oracle: the shared semantics suite."""

import pytest

from semantics import *  # noqa: F403  (collects the suite's test_* functions)
from semantics import Case

CASES = [Case("reference")]


@pytest.fixture(params=CASES, ids=str)
def case(request):
    request.param.skip_if_unavailable()
    return request.param

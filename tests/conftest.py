"""Shared fixtures: a fixed seed per test, and the float64 oracle.

Every test starts with torch's global RNG seeded by ``_seeded`` (autouse): by default from the
test's node id (CRC-32), so a run is the same on every machine, in any order and under
``pytest -n``. ``FUSED_CE_TEST_SEED=random`` opts in to a fresh seed per test from
``os.urandom`` (to look for tolerances that hold only by chance); ``FUSED_CE_TEST_SEED=<int>``
replays one. The seed is printed, so pytest shows it, with the command to replay, beside any
failure. Tests that need the value ask for the ``seed`` fixture.

``oracle`` is the plain-torch float64 definition of the loss (docs/design.md §1): materialised
float64 logits, softcap, ``F.cross_entropy`` with torch's label smoothing, the PaLM z-loss,
transformers' reductions. Tests compare every backend against it, never against a backend.
"""

from __future__ import annotations

import os
import zlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fused_ce_patch.numerics import relative_error


_DISTRIBUTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "")


def pytest_collection_modifyitems(config, items):
    """Every test under tests/distributed/ is marked ``distributed`` (it spawns process groups;
    its own CI step, docs/testing.md), so a new file there needs no marker of its own."""
    for item in items:
        if str(item.path).startswith(_DISTRIBUTED):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(autouse=True, scope="session")
def _proof_cache(tmp_path_factory):
    """Proofs of the live model (fused_ce_patch/hf/proof.py) are cached in a directory of this
    session only: every run proves afresh, and no run reads or writes the user's cache."""
    before = os.environ.get("FUSED_CE_CACHE_DIR")
    os.environ["FUSED_CE_CACHE_DIR"] = str(tmp_path_factory.mktemp("fused_ce_cache"))
    yield
    if before is None:
        os.environ.pop("FUSED_CE_CACHE_DIR", None)
    else:
        os.environ["FUSED_CE_CACHE_DIR"] = before


def seed_for(nodeid: str, setting: str | None) -> int:
    """The seed of the test ``nodeid`` under ``FUSED_CE_TEST_SEED=setting``: unset or empty, a
    fixed one from the node id; ``"random"``, a fresh one; an integer, that integer."""
    if not setting:
        return zlib.crc32(nodeid.encode())
    if setting.strip().lower() == "random":
        return int.from_bytes(os.urandom(4), "little")
    try:
        return int(setting)
    except ValueError:
        raise ValueError(
            f"FUSED_CE_TEST_SEED={setting!r}: expected an integer or 'random'"
        ) from None


@pytest.fixture(autouse=True)
def _seeded(request):
    value = seed_for(request.node.nodeid, os.environ.get("FUSED_CE_TEST_SEED"))
    torch.manual_seed(value)
    print(f"seed = {value} (replay: FUSED_CE_TEST_SEED={value} python -m pytest "
          f"'{request.node.nodeid}')")
    return value


@pytest.fixture
def seed(_seeded):
    """The seed torch's global RNG got at the start of this test (see the module docstring)."""
    return _seeded


@pytest.fixture
def one_thread():
    """Run the test on one intra-op thread. The core suites use tiny tensors, for which an
    OpenMP team only adds latency — a lot of it on a busy 2-core CI runner."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def oracle_loss(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    num_items_in_batch=None,
    shift=False,
    softcap=None,
    label_smoothing=0.0,
    z_loss=0.0,
):
    """The loss of docs/design.md §1 in float64, differentiable w.r.t. the float64 inputs given.

    Inputs of another dtype are upcast first (a differentiable cast), so gradients reach
    them too. Returns float64.
    """
    h = hidden.double()
    w = weight.double()
    labels = labels.long()
    if shift:
        pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
        labels = torch.cat([labels[..., 1:], pad], dim=-1)
    z = h @ w.t()
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z.reshape(-1, w.shape[0])
    y = labels.reshape(-1)
    counted = y != ignore_index
    per = F.cross_entropy(
        z, y, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    if z_loss:
        per = per + z_loss * torch.logsumexp(z, dim=-1).square() * counted
    if reduction == "none":
        return per.view(labels.shape)
    total = per.sum()
    if num_items_in_batch is not None:
        return total / torch.as_tensor(num_items_in_batch, dtype=torch.float64)
    if reduction == "mean":
        return total / max(int(counted.sum()), 1)
    return total


rel_err = relative_error  # ``||a - b|| / ||b||`` in float64: fused_ce_patch.numerics


def one_ulp_err(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The relative error (as :func:`rel_err`) of a result that is one ulp of ``dtype`` off
    ``ref`` in every element: ``||ulp(ref)|| / ||ref||`` (ulps below ``dtype``'s smallest
    normal taken at it).

    A floor for tensors of a few dozen elements, where one implementation's error being
    1.25x another's is chance: one element's rounding dominates the norm. Rounding once
    errs by at most half an ulp per element, rounding twice by about one; a wrong layout or a
    lost term errs by far more."""
    info = torch.finfo(dtype)
    r = ref.detach().double()
    ulp = torch.exp2(torch.floor(torch.log2(r.abs().clamp(min=info.tiny)))) * info.eps
    return float(ulp.norm() / r.norm().clamp(min=torch.finfo(torch.float64).tiny))


@pytest.fixture(scope="session")
def oracle():
    """``oracle.loss(...)`` (float64 loss), ``oracle.rel_err(a, b)`` and
    ``oracle.one_ulp_err(ref, dtype)``."""
    return SimpleNamespace(loss=oracle_loss, rel_err=rel_err, one_ulp_err=one_ulp_err)

"""The ``torch`` backend: the shared semantics suite at four budgets, then what is specific to
the chunked algorithm (its chunk plans, its memory bound, its two schedules)."""

from __future__ import annotations

import math

import pytest
import torch

from semantics import *  # noqa: F403  (collects the suite's test_* functions)
from semantics import AllocSpy, Case, check_against_oracle, make

from fused_ce_patch import fused_linear_cross_entropy
from fused_ce_patch.backends import chunked, torch_chunked
from fused_ce_patch.backends.base import LossSpec

ROW_CHUNKS = 64 * 1024  # V=1009 float32: 16 rows a chunk, so 67 rows make 5 (the last of 3)
VOCAB_TILES = 4096  # V=1009 float32: 16 rows x 64 columns, 16 tiles a row (the last of 49)

CASES = [
    Case("torch"),  # DEFAULT_BUDGET
    Case("torch", logits_budget=ROW_CHUNKS),
    Case("torch", logits_budget=VOCAB_TILES),
    Case("torch", logits_budget=0),  # recompute schedule
]


@pytest.fixture(params=CASES, ids=str)
def case(request):
    request.param.skip_if_unavailable()
    return request.param


def _plan(n, v, dtype, budget, spec=LossSpec()):
    kernel = torch_chunked.TorchKernel()
    return chunked.plan_chunks(n, v, kernel.bytes_per_logit(dtype, spec), budget)


def test_cases_exercise_what_they_claim():
    rows = _plan(67, 1009, torch.float32, ROW_CHUNKS)
    assert rows.vocab_tile == 1009 and rows.rows == 16 and 67 % rows.rows
    tiles = _plan(67, 1009, torch.float32, VOCAB_TILES)
    assert tiles.vocab_tile < 1009 and 1009 % tiles.vocab_tile
    soft = _plan(69, 509, torch.float32, VOCAB_TILES, LossSpec(softcap=30.0))
    assert soft.vocab_tile < 509
    assert _plan(4096, 128256, torch.float32, torch_chunked.DEFAULT_BUDGET).vocab_tile == 128256


def test_tile_holding_only_the_target_block():
    """Tiles of two columns: [0, ln 2] then [ln 3, ln 4] (the target's). Normalising over the
    target's tile alone would give ln(7/3) (docs/design.md §1)."""
    z = torch.tensor([[0.0, math.log(2), math.log(3), math.log(4)]], dtype=torch.float64)
    hidden = torch.ones(1, 1, dtype=torch.float64)
    labels = torch.tensor([2])
    assert _plan(1, 4, torch.float64, 16).vocab_tile == 2
    for reduction in ("sum", "none"):
        for budget in (16, 0):
            out = fused_linear_cross_entropy(
                hidden, z.t().contiguous(), labels, backend="torch", logits_budget=budget,
                reduction=reduction,
            )  # fmt: skip
            assert abs(float(out.sum()) - 1.2039728043259361) < 1e-14
            assert abs(float(out.sum()) - 0.8472978603872037) > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("budget", [256 * 1024, 32 * 1024, 0])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_transient_memory_follows_the_budget(budget, softcap, dtype, reduction):
    """No tensor created in forward+backward (other than the gradients) exceeds the budget."""
    n, h, v = 256, 48, 4096  # all logits: 4 MiB in float32
    case = Case("torch", logits_budget=budget)
    hidden, weight, labels, _ = make(case, (n,), h, v, dtype=dtype)
    spy = AllocSpy()
    with spy:
        out = case.loss(hidden, weight, labels, softcap=softcap, reduction=reduction)
        out.sum().backward()
    grads = {(n, h), (v, h)}
    biggest = max(nb for shape, nb in spy.created if shape not in grads)
    limit = budget or torch_chunked.MIN_TILE_BYTES
    assert biggest <= limit, f"a {biggest}-byte temporary under a {limit}-byte budget"
    # ...and the budget is what sizes the chunks (its largest float32 buffer is at least a
    # third of it: 4 of at most 12 bytes per logit)
    assert biggest >= limit // 4, f"largest temporary {biggest} bytes, budget {limit}"


@pytest.mark.parametrize("opts", [{}, {"softcap": 30.0, "label_smoothing": 0.1, "z_loss": 1e-3}])
def test_eager_and_recompute_schedules_agree(oracle, opts):
    """Scalar reductions take the eager schedule (grads in forward) at a positive budget and
    the recompute schedule at 0; both match the oracle, under tiling too."""
    hidden, weight, labels, bias = make(Case("torch"), (3, 31), 40, 701, bias=True,
                                        logit_std=20.0)  # fmt: skip
    for budget in (None, 4096, 512, 0):
        case = Case("torch", logits_budget=budget)
        check_against_oracle(case, oracle, hidden, weight, labels, bias, **opts)


def test_float64_stays_float64(oracle):
    case = Case("torch", logits_budget=2048)
    hidden, weight, labels, bias = make(case, (2, 9), 12, 301, dtype=torch.float64, bias=True)
    out, _ = check_against_oracle(case, oracle, hidden, weight, labels, bias, softcap=4.0)
    assert out.dtype == torch.float64

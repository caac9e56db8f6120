"""A loss block that selects positions of the logits before the loss (issue 37).

GIT puts its image positions before the text and drops them in the loss block
(``shifted_logits = logits[:, num_image_tokens:-1, :].contiguous()``, then
``self.loss_function(logits=shifted_logits, labels=None, shift_labels=...)``). The rewrite runs
those statements as written; the deferred logits answer a positions-only index with the
deferred logits of those positions (hf/forward.py ``DeferredLogits.__getitem__``), and any
other index with real logits.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from fused_ce_patch import apply_fused_ce
from fused_ce_patch.hf import forward as fwd
from fused_ce_patch.hf.sentinel import NotMaterializedLogits
from fused_ce_patch.hf.tiny import tiny_config
from hf_helpers import assert_step_close, step

pytestmark = pytest.mark.usefixtures("fresh_proofs")  # tests/hf/conftest.py

V = 300


def _git():
    config = tiny_config("git")  # a 32-pixel image: 5 image positions before the text
    config.vocab_size = V
    torch.manual_seed(0)
    return transformers.GitForCausalLM(config).double().train()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (2, 10), generator=g)
    labels = ids.clone()
    labels[1, 7:] = -100
    pixels = torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64)
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels}


_run = step


def _assert_same(got, want):
    # stock's ForCausalLMLoss rounds the float64 logits to float32 (~6e-8 relative); the fused
    # loss keeps float64: 1e-6 / 1e-5 cover that rounding with margin
    assert_step_close(got, want, 1e-6, 1e-5)


@pytest.mark.parametrize("with_shift_labels", [False, True])
def test_git_text_positions_after_the_image_are_fused_and_match_stock(with_shift_labels):
    model, batch = _git(), _batch()
    kw = {}
    if with_shift_labels:  # already aligned with the text logits: no shift in the block
        kw["shift_labels"] = torch.roll(batch["labels"], -1, dims=1)
    want = _run(model, batch, **kw)
    apply_fused_ce(model, backend="torch")
    seen = []
    real = fwd.materialize
    fwd.materialize = lambda logits, reason: seen.append(reason) or real(logits, reason)
    try:
        got = _run(model, batch, **kw)
    finally:
        fwd.materialize = real
    assert seen == []
    assert isinstance(got[0].logits, NotMaterializedLogits)
    _assert_same(got, want)


def test_a_call_that_needs_real_logits_materialises_all_positions_then_the_slice():
    model, batch = _git(), _batch()
    apply_fused_ce(model, backend="torch")
    # a hook added after the patch: the head can no longer be read as one linear map
    model.output.register_forward_hook(lambda module, args, out: out * 0.5)
    with pytest.warns(RuntimeWarning, match="cannot be read as one linear map"):
        out = model(**batch)
    with fwd.stock_path():
        want_out = model(**batch)
    assert torch.equal(out.logits, want_out.logits)  # real logits of every position
    torch.testing.assert_close(out.loss, want_out.loss, rtol=0, atol=0)


def test_positions_only_index_and_other_indexes():
    model = _git()
    hidden = torch.randn(2, 7, model.config.hidden_size, dtype=torch.float64)
    options = fwd.FusedCEOptions(backend="torch")
    deferred = fwd.DeferredLogits(model, hidden, model.get_output_embeddings(), options)
    rows = deferred[:, 2:-1, :].contiguous()
    assert isinstance(rows, fwd.DeferredLogits) and rows.shape == (2, 4, V)
    assert deferred.real is None
    with pytest.warns(RuntimeWarning, match="indexes the logits other than by positions"):
        vocab_cut = deferred[:, :, :10]
    assert torch.equal(vocab_cut, model.get_output_embeddings()(hidden)[:, :, :10])
    # the child materialises through its parent: stock's arithmetic, then the slice
    with pytest.warns(RuntimeWarning, match="because a test asks"):
        real = fwd.materialize(rows, "a test asks")
    assert torch.equal(real, deferred.real[:, 2:-1, :])
    for key in [(slice(None), 1, slice(None)), (slice(None), slice(0, 4, 2), slice(None)),
                (Ellipsis, slice(None)), 0]:
        assert not fwd._positions_only(key, 3), key

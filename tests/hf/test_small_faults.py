"""Issue 9 item 4 through a patched model: options the stock forward accepts work fused too."""

from __future__ import annotations

import torch

from fused_ce_patch import apply_fused_ce
from hf_helpers import LOSS_RTOL, assert_close_rel, batch, build_model, reference_copy


def test_float_num_items_in_batch_in_the_patched_training_forward(spy):
    # Regression: a Python float raised TypeError on the fused path; stock divides by it.
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model)
    b = batch()
    for n in (7.0, 7.5):
        got = model(**b, num_items_in_batch=n).loss
        want = ref(**b, num_items_in_batch=n).loss
        assert_close_rel(got, want, LOSS_RTOL, f"num_items_in_batch={n}")
    assert spy.count == 2
    assert torch.isfinite(got)

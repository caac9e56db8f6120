"""Distributed modes on CPU with 2 processes and gloo: the patched model's loss and gathered
gradients after one step equal one process running the stock (unpatched) model on the whole
batch, and a spy shows the fused kernel ran on the full ``[V, H]`` weight.

All modes run in one spawn (imports dominate the cost); each mode is then one test.
"""

from __future__ import annotations

import os

import pytest
import torch

import dist_workers as w

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
WORLD = 2

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("dist")
    modes = (*w.MODES, *w.REFUSED)
    mp.spawn(w.worker, args=(WORLD, str(out / "init"), modes, str(out)), nprocs=WORLD)
    return out


def _reference(tied: bool):
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = w.build(tied=tied)
    model.loss_function = ForCausalLMLoss  # transformers' own loss, whatever LOSS_MAPPING holds
    ids, labels = w.batch()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("mode", w.MODES)
def test_mode_matches_single_process_stock(results, mode):
    err = results / f"{mode}.err"
    assert not err.exists(), err.read_text()
    got = torch.load(results / f"{mode}.pt")
    assert got["spy"] == [(w.VOCAB, w.HIDDEN)], "the fused kernel must run once on the full weight"
    loss, grads = _reference(tied=mode == "fsdp2_tied")
    assert _rel(got["loss"], loss) <= LOSS_RTOL, (got["loss"], loss)
    assert set(got["grads"]) == set(grads)
    for name, g in grads.items():
        assert _rel(got["grads"][name], g) <= GRAD_RTOL, name


def test_sharded_weight_is_refused(results):
    err = results / "fsdp2_head_unhooked.err"
    assert err.exists(), "reading a DTensor shard must raise"
    text = err.read_text()
    assert "UnsupportedModelError" in text and "DTensor" in text, text

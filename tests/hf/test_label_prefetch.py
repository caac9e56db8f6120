"""The loss's label read, started by the patched forward (fused_ce_patch/label_prefetch.py).

The numbers a started read gives are those the loss computes itself; they are used only for
the call they were made for (anything else falls back to the loss's own read); a patched
model uses them, eager and compiled, with stock's loss and gradients; a bad label still
raises. The CUDA path (pinned copy behind an event) is tested in tests/gpu/test_compile_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from hf_helpers import (GRAD_RTOL, LOSS_RTOL, VOCAB, assert_step_close, batch, build_model,
                        reference_copy, step)

from fused_ce_patch import apply_fused_ce, label_prefetch
from fused_ce_patch.errors import LabelOutOfRangeError
from fused_ce_patch.loss import _check_labels_and_num_items, _shift


class TakeSpy:
    """Records what each ``label_prefetch.take`` call returned."""

    def __init__(self, monkeypatch):
        self.results = []
        original = label_prefetch.take

        def spied(*args, **kwargs):
            out = original(*args, **kwargs)
            self.results.append(out)
            return out

        monkeypatch.setattr(label_prefetch, "take", spied)


def _labels(seed=0, shape=(3, 11), vocab=50):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(3, vocab, shape, generator=g)  # no 0: the ignored ones read as 0
    labels[0, :4] = -100
    labels[2, 7] = -100
    return labels


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("items", [None, "tensor", "int"])
def test_started_read_gives_the_loss_own_numbers(shift, items):
    labels = _labels(seed=3)
    num_items = {None: None, "tensor": torch.tensor(17), "int": 17}[items]
    host = label_prefetch.start(labels, shift=shift, num_items_in_batch=num_items)
    got = label_prefetch.take(host, labels, -100, shift, num_items)
    flat = (_shift(labels, -100) if shift else labels).reshape(-1)
    _, n_valid, want_items = _check_labels_and_num_items(flat, 50, -100, num_items)
    read = torch.where(flat != -100, flat, 0)  # ignored labels read as 0 (in range)
    assert got[:3] == (read.min().item(), read.max().item(), n_valid)
    assert n_valid == int((flat != -100).sum())
    assert got[3] == (want_items if items == "tensor" else None)


def test_started_read_with_nothing_counted():
    labels = torch.full((2, 5), -100)
    labels[:, 0] = 7  # shifted out: nothing counts
    host = label_prefetch.start(labels, shift=True)
    assert label_prefetch.take(host, labels, -100, True, None) == (0, 0, 0, None)


def test_started_read_is_not_used_for_another_call():
    labels = _labels()
    host = label_prefetch.start(labels, shift=True, num_items_in_batch=torch.tensor(9.0))
    items = torch.tensor(9.0)
    take = label_prefetch.take
    assert take(host, labels, -100, True, None) is not None  # the call it was made for
    assert take(host, labels, -1, True, None) is None  # another ignore_index
    assert take(host, labels, -100, False, None) is None  # not shifted
    assert take(host, labels.view(-1), -100, True, None) is None  # other rows shift out
    assert take(host, labels.clone(), -100, True, None) is None  # other labels
    assert take(host, labels, -100, True, items) is None  # another num_items tensor
    assert take(None, labels, -100, True, None) is None
    assert take(torch.zeros(12, dtype=torch.int64), labels, -100, True, None) is None
    labels[1, 3] = 5  # changed in place since: the loss reads them itself
    assert take(host, labels, -100, True, None) is None


def test_old_reads_are_forgotten():
    labels = _labels()
    first = label_prefetch.start(labels)
    for _ in range(label_prefetch._KEEP):
        label_prefetch.start(labels)
    assert label_prefetch.take(first, labels, -100, True, None) is None
    assert len(label_prefetch._READY) <= label_prefetch._KEEP


def test_nothing_started_for_labels_it_cannot_read():
    assert label_prefetch.start(None) is None
    assert label_prefetch.start(_labels().int()) is None  # the loss converts these itself
    assert label_prefetch.start(torch.tensor(3), shift=True) is None
    assert label_prefetch.start(torch.zeros(0, 5, dtype=torch.int64)) is None
    assert label_prefetch.start(torch.zeros(2, 1, dtype=torch.int64), shift=True) is None
    assert label_prefetch.start(torch.zeros(2, 1, dtype=torch.int64), shift=False) is not None
    assert label_prefetch.start(_labels(), ignore_index=torch.tensor(-100)) is None


@pytest.mark.parametrize("compiled", [False, True])
def test_patched_model_uses_the_started_read(monkeypatch, compiled):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    spy = TakeSpy(monkeypatch)
    data = batch()
    run = torch.compile(model, backend="aot_eager") if compiled else model
    loss = run(**data).loss
    loss.backward()
    got = (None, loss.detach(), {k: p.grad for k, p in model.named_parameters()})
    assert len(spy.results) == 1 and spy.results[0] is not None
    counted = data["labels"][:, 1:]
    assert spy.results[0][2] == int((counted != -100).sum())
    assert_step_close(got, step(ref, data), LOSS_RTOL, GRAD_RTOL)


def test_patched_model_with_num_items_tensor(monkeypatch):
    model = build_model("qwen2")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    spy = TakeSpy(monkeypatch)
    data = batch()
    n = torch.tensor(23)
    got = step(model, data, num_items_in_batch=n)
    assert spy.results[0] is not None and spy.results[0][3] == 23.0
    assert_step_close(got, step(ref, data, num_items_in_batch=n), LOSS_RTOL, GRAD_RTOL)


def test_patched_model_with_shift_labels(monkeypatch):
    model = build_model("llama")
    ref = reference_copy(model)
    apply_fused_ce(model, backend="torch")
    spy = TakeSpy(monkeypatch)
    data = batch()
    data["shift_labels"] = _shift(data["labels"], -100)
    got = step(model, data)
    assert spy.results[0] is not None
    assert_step_close(got, step(ref, data), LOSS_RTOL, GRAD_RTOL)


def test_out_of_range_label_still_raises():
    model = build_model("llama")
    apply_fused_ce(model, backend="torch")
    data = batch()
    data["labels"][1, 4] = VOCAB
    with pytest.raises(LabelOutOfRangeError, match=f"label {VOCAB} is outside"):
        model(**data)

"""Context parallelism on 2 CPU processes (gloo): each rank runs a sequence shard of a tiny
Llama with ``shift_labels`` and ``position_ids`` sharded as HF Trainer shards them and
``num_items_in_batch`` counted before sharding as Trainer counts it (cp_workers.py). The
attention is a test harness (all-gather of k/v, causal mask by global positions) standing in
for torch's ring attention, which needs CUDA. Checked for contiguous and zigzag shards, with
and without ``num_items_in_batch``, with ignored labels and a rank whose shard counts nothing:
the patched model's per-rank losses equal the stock model's (NaN where stock gives NaN), the
fused kernel runs on every rank, and the reported loss and the averaged gradients of both equal
one process running the stock model on the whole sequence. The same on 4 processes as CP x TP
(lm_head vocabulary-parallel on each sequence shard, FSDP2 over the CP dimension)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import cp_workers as w
import dist_workers as dw

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("cp")
    path = out / "model"
    dw.build(tied=False).save_pretrained(path)
    mp.spawn(w.worker, args=(w.CP_SIZE, str(out / "init"), w.CASES, str(path), str(out)),
             nprocs=w.CP_SIZE)
    return out


@pytest.fixture(scope="module")
def results_tp(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("cp_tp")
    path = out / "model"
    dw.build(tied=False).save_pretrained(path)
    world = w.CP_SIZE * w.TP_SIZE
    mp.spawn(w.worker, args=(world, str(out / "init"), w.TP_CASES, str(path), str(out),
                             w.TP_SIZE), nprocs=world)
    return out


def load(results, name):
    errors = sorted(results.glob(f"{name}.*.err"))
    assert not errors, errors[0].read_text()
    return torch.load(results / f"{name}.pt")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def same_loss(got, want):
    """Equal within LOSS_RTOL, or both NaN."""
    if math.isnan(want):
        return math.isnan(got)
    return abs(got - want) <= LOSS_RTOL * abs(want) + 1e-12


def single_process(case):
    """What Trainer reports and the gradient it steps with, from one process running the
    stock model (eager attention) on the whole sequence. With ``num_items_in_batch``: the
    stock loss of the whole batch over that count. Without: each CP rank's own mean over its
    shard, averaged over the ranks (NaN when a rank counts nothing; that rank's gradient is 0,
    as stock's backward of a mean over nothing gives)."""
    model = dw.build(tied=False)
    ids, labels = w.batch(case["labels"], case["layout"])
    if case["items"]:
        items = labels[:, 1:].ne(-100).sum().float()
        out = model(input_ids=ids, labels=labels, num_items_in_batch=items)
        out.loss.backward()
        return out.loss.item(), {n: p.grad for n, p in model.named_parameters()}
    shift = w.trainer_inputs(ids, labels)["shift_labels"]
    logits = model(input_ids=ids).logits.float()
    per_token = F.cross_entropy(logits.reshape(-1, dw.VOCAB), shift.reshape(-1),
                                reduction="none").view(shift.shape)
    means = []
    for rank in range(w.CP_SIZE):
        pos = w.shard_positions(case["layout"], rank, w.CP_SIZE)
        counted = shift[:, pos].ne(-100).sum()
        means.append(per_token[:, pos].sum() / counted if counted else None)
    total = sum(m for m in means if m is not None) / w.CP_SIZE
    total.backward()
    loss = float("nan") if None in means else total.item()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def check_against_one_process(got, case):
    loss, grads = single_process(case)
    assert same_loss(got["reported"].item(), loss), (got["reported"], loss)
    assert set(got["grads"]) == set(grads)
    for name, g in grads.items():
        assert rel(got["grads"][name], g) <= GRAD_RTOL, (name, rel(got["grads"][name], g))


CASE_IDS = [c["name"].removeprefix("fused_") for c in w.CASES if c["model"] == "fused"]
TP_CASE_IDS = [c["name"].removeprefix("tp_fused_") for c in w.TP_CASES if c["model"] == "fused"]


def check_patched_against_stock(results, prefix, name, world):
    case = next(c for c in w.CASES if c["name"] == f"fused_{name}")
    fused, stock = load(results, f"{prefix}fused_{name}"), load(results, f"{prefix}stock_{name}")
    assert fused["attention"] == stock["attention"] == w.ATTENTION
    layers = fused["layers"]  # (fused kernel calls, harness attention calls) on each process
    assert fused["calls"] == [(1, layers)] * world, fused["calls"]
    assert stock["calls"] == [(0, layers)] * world, stock["calls"]
    for rank in range(w.CP_SIZE):  # each rank's own loss, as stock gives it (NaN included)
        assert same_loss(fused["losses"][rank].item(), stock["losses"][rank].item()), (
            rank, fused["losses"], stock["losses"])
    if case["items"]:
        assert fused["num_items"].dtype == torch.float32  # Trainer's count / cp_size
    check_against_one_process(fused, case)


@pytest.mark.parametrize("name", CASE_IDS)
def test_patched_cp_model_matches_stock_cp_and_one_process(results, name):
    check_patched_against_stock(results, "", name, w.CP_SIZE)


@pytest.mark.parametrize("name", TP_CASE_IDS)
def test_patched_cp_x_tp_model_matches_stock_and_one_process(results_tp, name):
    """CP x TP on 4 processes: transformers' TP (lm_head vocabulary-parallel, the fused loss
    computed from each rank's vocabulary shard of its sequence shard) on a (cp, tp) mesh,
    FSDP2 over the cp dimension; the stock model is checked against one process too."""
    check_patched_against_stock(results_tp, "tp_", name, w.CP_SIZE * w.TP_SIZE)
    check_against_one_process(load(results_tp, f"tp_stock_{name}"),
                              next(c for c in w.CASES if c["name"] == f"stock_{name}"))


@pytest.mark.parametrize("name", CASE_IDS)
def test_stock_cp_harness_matches_one_process(results, name):
    # the comparison above is only as good as the harness's own agreement with one process
    case = next(c for c in w.CASES if c["name"] == f"stock_{name}")
    check_against_one_process(load(results, f"stock_{name}"), case)


def test_shard_ignored_rank_counts_nothing(results):
    """The rank whose shard counts no label: 0 with ``num_items_in_batch`` (a sum over
    nothing), NaN without (a mean over nothing), fused as stock; the other rank finite."""
    for layout in w.LAYOUTS:
        for model in ("stock", "fused"):
            with_items = load(results, f"{model}_{layout}_shard_ignored_items")["losses"]
            mean = load(results, f"{model}_{layout}_shard_ignored_mean")["losses"]
            assert with_items[1].item() == 0.0 and with_items[0].item() > 0, with_items
            assert math.isnan(mean[1].item()) and math.isfinite(mean[0].item()), mean


@pytest.mark.parametrize("layout,rank,want", [
    ("contiguous", 0, list(range(0, 8))), ("contiguous", 1, list(range(8, 16))),
    ("zigzag", 0, [0, 1, 2, 3, 12, 13, 14, 15]), ("zigzag", 1, [4, 5, 6, 7, 8, 9, 10, 11]),
])
def test_shard_positions(layout, rank, want):
    assert w.shard_positions(layout, rank, 2, 16).tolist() == want

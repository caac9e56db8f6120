"""vocab_parallel_linear_cross_entropy on 2 and 4 CPU processes (gloo): the loss (equal on
every rank), the whole hidden-state gradient (equal on every rank) and each rank's weight and
bias gradient shards, put together, equal a single-process float64 reference computed from
materialised logits (relative 1e-10 for float64 inputs, 1e-5 for float32), for every option,
uneven and empty shards, chunks and tiles that divide nothing; ``num_items_in_batch`` of any
value as stock divides (negative; 0 or NaN give stock's inf/NaN loss and the infs and NaNs of
stock's gradients, element for element); ranks that disagree raise; a dispatch watcher shows
no rank creates a tensor of tokens x vocab / tp elements when the budget is smaller.
Single-process checks (options, a world of one) at the end."""

from __future__ import annotations

import math

import pytest
import torch

import vp_workers as w

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

RTOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 2e-2}
#: budgets (bytes) that force vocabulary tiles and row chunks that divide neither N nor V_r
TILES64 = 16 * 5 * 16  # float64 with softcap: 16 bytes a logit -> 16 rows x 5 columns
TILES32 = 16 * 3 * 8

BASE = {"n": 26, "v": 37, "h": 8}
CASES2 = [
    {"name": "f64_plain", **BASE},
    {"name": "f64_tiles_softcap_scale_bias", **BASE, "softcap": 5.0, "logit_scale": 0.7,
     "bias": True, "logits_budget": TILES64, "wscale": 3.0},
    {"name": "f64_smooth_zloss_shift", **BASE, "lead": (2, 13), "label_smoothing": 0.1,
     "z_loss": 1e-3, "ignored": 0.3, "shift": True},
    {"name": "f64_none_upstream", **BASE, "reduction": "none", "ignored": 0.2,
     "logits_budget": TILES64, "bias": True},
    {"name": "f64_num_items", **BASE, "num_items_in_batch": 7.0, "ignored": 0.25},
    {"name": "f64_num_items_negative", **BASE, "num_items_in_batch": -5.0, "ignored": 0.25,
     "label_smoothing": 0.1},
    {"name": "f64_sum_budget0", **BASE, "reduction": "sum", "logits_budget": 0},
    {"name": "f64_splits_30_7", **BASE, "splits": [30, 7], "label_smoothing": 0.2,
     "logits_budget": TILES64},
    {"name": "f64_all_ignored", **BASE, "ignored": 1.0},
    {"name": "f64_ignore_index_5", **BASE, "n": 60, "splits": [20, 17], "ignore_index": 5},
    {"name": "f32_plain", **BASE, "dtype": "float32", "wscale": 2.0},
    {"name": "f32_all_options", **BASE, "dtype": "float32", "softcap": 4.0, "logit_scale": 1.3,
     "label_smoothing": 0.1, "z_loss": 1e-4, "ignored": 0.2, "bias": True,
     "logits_budget": TILES32, "wscale": 2.0},
    {"name": "bf16_whole_rows", **BASE, "dtype": "bfloat16", "bias": True, "ignored": 0.2},
    {"name": "bf16_tiles_softcap", **BASE, "dtype": "bfloat16", "softcap": 4.0,
     "logits_budget": TILES32},
    {"name": "f32_watch", "n": 64, "v": 101, "h": 16, "dtype": "float32",
     "logits_budget": 16 * 8 * 4, "watch": True},
    {"name": "f32_watch_default", "n": 64, "v": 101, "h": 16, "dtype": "float32",
     "watch": True},
]
NAN2 = {"name": "f64_nan_hidden", **BASE, "nan": True}
#: a learnable logit scale (0-d tensor that requires grad) with a bias: its gradient is the
#: whole vocabulary's on every rank (the bias term summed over the shards)
SCALE_TENSOR2 = [
    {"name": "f64_scale_tensor_bias", **BASE, "logit_scale": 0.7, "scale_tensor": True,
     "bias": True, "softcap": 5.0, "ignored": 0.2, "logits_budget": TILES64},
    {"name": "f32_scale_tensor", **BASE, "logit_scale": 1.3, "scale_tensor": True,
     "dtype": "float32", "label_smoothing": 0.1},
]
#: num_items_in_batch 0 or NaN: stock's sum / n is inf or NaN, and its gradients hold infs and
#: NaNs where autograd's order puts them (floats are passed as tensors, ints as ints). The
#: all-ignored one is what Trainer passes for an optimizer step without a counted label.
NONFINITE2 = [
    {"name": "nf_zero_plain", **BASE, "num_items_in_batch": 0.0, "ignored": 0.25},
    {"name": "nf_zero_int_all_options", **BASE, "num_items_in_batch": 0, "ignored": 0.25,
     "softcap": 5.0, "label_smoothing": 0.1, "z_loss": 1e-3, "bias": True,
     "logits_budget": TILES64, "wscale": 3.0},
    {"name": "nf_zero_all_ignored", **BASE, "num_items_in_batch": 0.0, "ignored": 1.0,
     "bias": True},
    {"name": "nf_nan_f32", **BASE, "num_items_in_batch": float("nan"), "dtype": "float32",
     "ignored": 0.25},
]
REFUSED2 = [
    ({"name": "err_labels_differ", **BASE, "corrupt_rank": 1}, "disagree on their labels"),
    ({"name": "err_gap", **BASE, "splits": [10, 20]}, "do not tile"),
    # one rank's labels differ with an equal checksum and one is out of range there: every rank
    # raises (the count of such labels is in the fingerprint), none waits in a collective
    ({"name": "err_out_of_range_on_one_rank", "n": 1000, "v": 37, "h": 4, "collide_rank": 1},
     "outside [0, V)"),
]
CASES4 = [
    {"name": "w4_f64_tiles_softcap", **BASE, "softcap": 5.0, "logits_budget": TILES64,
     "bias": True, "ignored": 0.2},
    {"name": "w4_f32_all_options", **BASE, "dtype": "float32", "softcap": 4.0,
     "logit_scale": 0.8, "label_smoothing": 0.1, "z_loss": 1e-4, "reduction": "none",
     "logits_budget": TILES32},
    {"name": "w4_f64_empty_shard", "n": 11, "v": 3, "h": 5, "label_smoothing": 0.1},
]


def spawn(tmp_path_factory, world, cases):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp(f"vp{world}")
    mp.spawn(w.worker, args=(world, str(out / "init"), cases, str(out)), nprocs=world)
    return out


@pytest.fixture(scope="module")
def results2(tmp_path_factory):
    return spawn(tmp_path_factory, 2, [*CASES2, NAN2, *NONFINITE2, *SCALE_TENSOR2,
                                       *(c for c, _ in REFUSED2)])


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    return spawn(tmp_path_factory, 4, CASES4)


def reference(case):
    """Loss and gradients from materialised float64 logits (docs/design.md §1)."""
    hidden, weight, bias, labels, upstream = w.problem(case)
    h = hidden.double().requires_grad_(True)
    wt = weight.double().requires_grad_(True)
    b = None if bias is None else bias.double().requires_grad_(True)
    z = h @ wt.t() if b is None else h @ wt.t() + b
    scale = None
    if case.get("logit_scale") is not None:
        scale = torch.tensor(case["logit_scale"], dtype=torch.float64, requires_grad=True)
        z = z * scale
    if case.get("softcap") is not None:
        z = case["softcap"] * torch.tanh(z / case["softcap"])
    ii = case.get("ignore_index", -100)
    y = labels
    if case.get("shift"):
        y = torch.cat([y[..., 1:], torch.full_like(y[..., :1], ii)], dim=-1)
    z, y = z.reshape(-1, case["v"]), y.reshape(-1)
    counted = y != ii
    lse = torch.logsumexp(z, dim=-1)
    nll = lse - z.gather(1, y.clamp(0, case["v"] - 1).unsqueeze(1)).squeeze(1)
    eps, lam = case.get("label_smoothing", 0.0), case.get("z_loss", 0.0)
    per = (1 - eps) * nll + eps * (lse - z.mean(-1)) + lam * lse * lse
    per = torch.where(counted, per, 0.0)
    reduction = case.get("reduction", "mean")
    if reduction == "none":
        loss = per.view(labels.shape)
        loss.backward(upstream)
    else:
        loss = per.sum()
        if case.get("num_items_in_batch") is not None:
            loss = loss / case["num_items_in_batch"]
        elif reduction == "mean":
            loss = loss / max(int(counted.sum()), 1)
        loss.backward()
    if case.get("scale_tensor"):
        return loss.detach(), h.grad, wt.grad, None if b is None else b.grad, scale.grad
    return loss.detach(), h.grad, wt.grad, None if b is None else b.grad


def rel(a, b):
    b = b.double()
    denom = b.norm()
    diff = (a.double() - b).norm()
    return (diff / denom).item() if denom > 0 else diff.item()


def gathered(results, case, world):
    for r in range(world):
        err = results / f"{case['name']}.{r}.err"
        assert not err.exists(), err.read_text()
    return [torch.load(results / f"{case['name']}.{r}.pt") for r in range(world)]


def check(results, case, world):
    got = gathered(results, case, world)
    loss, dh, dw, db = reference(case)
    tol = RTOL[case.get("dtype", "float64")]
    for g in got[1:]:  # every rank ends with the same loss and the whole dH
        assert torch.equal(g["loss"], got[0]["loss"])
        assert torch.equal(g["dh"], got[0]["dh"])
    assert got[0]["loss"].dtype == (torch.float64 if tol == 1e-10 else torch.float32)
    assert rel(got[0]["loss"], loss) <= tol, (got[0]["loss"], loss)
    assert rel(got[0]["dh"], dh) <= tol
    for g in got:
        assert g["dw"].shape == (g["stop"] - g["start"], case["h"])
    assert rel(torch.cat([g["dw"] for g in got]), dw) <= tol
    if db is not None:
        assert rel(torch.cat([g["db"] for g in got]), db) <= tol
    return got


@pytest.mark.parametrize("case", CASES2, ids=[c["name"] for c in CASES2])
def test_two_ranks_match_single_process_float64(results2, case):
    got = check(results2, case, 2)
    if case["name"] == "f64_all_ignored":
        assert got[0]["loss"].item() == 0.0 and not got[0]["dh"].any()


@pytest.mark.parametrize("case", CASES4, ids=[c["name"] for c in CASES4])
def test_four_ranks_match_single_process_float64(results4, case):
    got = check(results4, case, 4)
    if case["name"] == "w4_f64_empty_shard":
        assert [g["stop"] - g["start"] for g in got] == [1, 1, 1, 0]


@pytest.mark.parametrize("case", SCALE_TENSOR2, ids=[c["name"] for c in SCALE_TENSOR2])
def test_learnable_logit_scale_gets_the_whole_gradient_on_every_rank(results2, case):
    got = gathered(results2, case, 2)
    loss, dh, dw, db, ds = reference(case)
    tol = RTOL[case.get("dtype", "float64")]
    for g in got:
        assert torch.equal(g["loss"], got[0]["loss"]) and torch.equal(g["dh"], got[0]["dh"])
        assert rel(g["ds"], ds) <= tol, (g["ds"], ds)
    assert rel(got[0]["loss"], loss) <= tol and rel(got[0]["dh"], dh) <= tol
    assert rel(torch.cat([g["dw"] for g in got]), dw) <= tol
    if db is not None:
        assert rel(torch.cat([g["db"] for g in got]), db) <= tol


def test_nan_propagates_to_every_rank(results2):
    got = gathered(results2, NAN2, 2)
    assert all(torch.isnan(g["loss"]) for g in got)


def stock_reference(case):
    """Loss and gradients of stock's chain, float64: ``F.cross_entropy(reduction="sum") /
    num_items_in_batch`` on materialised logits (z-loss added per counted row)."""
    import torch.nn.functional as F

    hidden, weight, bias, labels, _ = w.problem(case)
    h, wt = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    b = None if bias is None else bias.double().requires_grad_(True)
    z = h @ wt.t() if b is None else h @ wt.t() + b
    if case.get("softcap") is not None:
        z = case["softcap"] * torch.tanh(z / case["softcap"])
    loss = F.cross_entropy(z, labels, reduction="sum",
                           label_smoothing=case.get("label_smoothing", 0.0))
    if case.get("z_loss"):
        loss = loss + case["z_loss"] * torch.logsumexp(z, -1)[labels != -100].square().sum()
    loss = loss / torch.tensor(case["num_items_in_batch"], dtype=torch.float64)
    loss.backward()
    return loss.detach(), h.grad, wt.grad, None if b is None else b.grad


def same_nonfinite(got, want, rtol):
    """The same NaNs and the same signed infs, element for element; finite values close."""
    got, want = got.double(), want.double()
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    assert torch.equal(got.isposinf(), want.isposinf()), (got, want)
    assert torch.equal(got.isneginf(), want.isneginf()), (got, want)
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("case", NONFINITE2, ids=[c["name"] for c in NONFINITE2])
def test_zero_or_nan_num_items_give_stocks_infs_and_nans(results2, case):
    got = gathered(results2, case, 2)
    loss, dh, dw, db = stock_reference(case)
    tol = RTOL[case.get("dtype", "float64")]
    for g in got[1:]:
        assert torch.equal(g["loss"].isnan(), got[0]["loss"].isnan())
        same_nonfinite(g["dh"], got[0]["dh"], 0)
    same_nonfinite(got[0]["loss"], loss, tol)
    same_nonfinite(got[0]["dh"], dh, tol)
    same_nonfinite(torch.cat([g["dw"] for g in got]), dw, tol)
    if db is not None:
        same_nonfinite(torch.cat([g["db"] for g in got]), db, tol)
    if case["name"] == "nf_zero_all_ignored":  # NaN loss (0 / 0), zero gradients, as stock
        assert got[0]["loss"].isnan() and not got[0]["dh"].any() and not got[0]["dw"].any()
    else:
        assert not got[0]["loss"].isfinite() and not dw.isfinite().all()


@pytest.mark.parametrize("case,words", REFUSED2, ids=[r[0]["name"] for r in REFUSED2])
def test_ranks_that_disagree_raise(results2, case, words):
    for r in range(2):  # every rank raises, none hangs
        err = results2 / f"{case['name']}.{r}.err"
        assert err.exists(), f"rank {r} did not raise"
        text = err.read_text()
        assert ("ValueError" in text or "LabelOutOfRangeError" in text) and words in text, text


def test_no_rank_allocates_tokens_times_shard(results2):
    """The dispatch watcher saw every tensor each rank created in forward and backward."""
    case = next(c for c in CASES2 if c["name"] == "f32_watch")
    got = gathered(results2, case, 2)
    for g in got:
        shard = g["stop"] - g["start"]
        assert g["largest"] < case["n"] * shard, "a [tokens, V/tp] tensor was created"
        # logits chunk (16 x 8) and its work copies, plus gradients and [N, H] buffers
        grads = (case["n"] * case["h"] * 3 + shard * case["h"] * 2) * 4
        assert g["peak"] <= grads + 4 * case["logits_budget"], g["peak"]
    default = gathered(results2, next(c for c in CASES2 if c["name"] == "f32_watch_default"), 2)
    # with the default budget (192 MiB) the whole [N, V/tp] shard fits and is taken at once
    assert all(g["largest"] >= case["n"] * (g["stop"] - g["start"]) for g in default)


# -- single process ---------------------------------------------------------------------------



def _small(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 4, generator=g, dtype=dtype)
    weight = torch.randn(7, 4, generator=g, dtype=dtype)
    labels = torch.randint(0, 7, (5,), generator=g)
    return hidden, weight, labels


def test_world_of_one_equals_fused_linear_cross_entropy(world_of_one):
    from fused_ce_patch import fused_linear_cross_entropy
    from fused_ce_patch.vocab_parallel import vocab_parallel_linear_cross_entropy

    hidden, weight, labels = _small()
    labels[1] = -100
    got = vocab_parallel_linear_cross_entropy(hidden, weight, labels, vocab_start=0,
                                              vocab_size=7, softcap=3.0, z_loss=1e-2)
    want = fused_linear_cross_entropy(hidden, weight, labels, softcap=3.0, z_loss=1e-2,
                                      backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_design_check_value(world_of_one):
    # docs/design.md §1: z = [0, ln 2, ln 3, ln 4], y = 2 -> ln(10/3); split it 2 + 2
    from fused_ce_patch.vocab_parallel import vocab_parallel_linear_cross_entropy

    hidden = torch.tensor([[1.0]], dtype=torch.float64)
    weight = torch.tensor([[0.0], [math.log(2)], [math.log(3)], [math.log(4)]],
                          dtype=torch.float64)
    got = vocab_parallel_linear_cross_entropy(hidden, weight, torch.tensor([2]), vocab_start=0,
                                              vocab_size=4, logits_budget=16)
    assert got.item() == pytest.approx(1.2039728043259361, rel=1e-14)


@pytest.mark.parametrize("kwargs,error,words", [
    ({"reduction": "avg"}, ValueError, "unknown reduction"),
    ({"softcap": True}, TypeError, "softcap"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"logit_scale": 0.0}, ValueError, "logit_scale"),
    ({"logit_scale": torch.ones(2)}, TypeError, "logit_scale"),
    ({"logit_scale": torch.tensor(2)}, TypeError, "logit_scale"),
    ({"label_smoothing": 2.0}, ValueError, "label_smoothing"),
    ({"z_loss": "x"}, TypeError, "z_loss"),
    ({"logits_budget": 1.5}, TypeError, "logits_budget"),
    ({"vocab_start": 1.0}, TypeError, "vocab_start"),
    ({"vocab_start": 3}, ValueError, "vocab_start"),
    ({"reduction": "none", "num_items_in_batch": 3}, ValueError, "num_items_in_batch"),
    ({"shift": "no"}, TypeError, "shift"),
])
def test_bad_options_raise(world_of_one, kwargs, error, words):
    from fused_ce_patch.vocab_parallel import vocab_parallel_linear_cross_entropy

    hidden, weight, labels = _small()
    call = {"vocab_start": 0, "vocab_size": 7, **kwargs}
    with pytest.raises(error, match=words):
        vocab_parallel_linear_cross_entropy(hidden, weight, labels, **call)


def test_bad_tensors_raise(world_of_one):
    from fused_ce_patch.vocab_parallel import vocab_parallel_linear_cross_entropy as vp

    hidden, weight, labels = _small()
    labels[2] = 9
    with pytest.raises(ValueError, match="label 9 is outside"):
        vp(hidden, weight, labels, vocab_start=0, vocab_size=7)
    hidden, weight, labels = _small()
    with pytest.raises(ValueError, match="labels must have hidden's leading shape"):
        vp(hidden, weight, labels[:3], vocab_start=0, vocab_size=7)
    with pytest.raises(TypeError, match="weight_shard is torch.float32"):
        vp(hidden, weight.float(), labels, vocab_start=0, vocab_size=7)
    with pytest.raises(TypeError, match="labels must be an integer"):
        vp(hidden, weight, labels.double(), vocab_start=0, vocab_size=7)


def test_dtensor_shard_other_layouts_raise(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fused_ce_patch.vocab_parallel import dtensor_vocab_shard

    mesh = init_device_mesh("cpu", (1,))
    weight = torch.randn(7, 4)
    sharded = distribute_tensor(weight, mesh, [Shard(0)])
    local, bias, start, vocab, group = dtensor_vocab_shard(sharded)
    assert torch.equal(local, weight) and bias is None and (start, vocab) == (0, 7)
    with pytest.raises(ValueError, match="only a vocabulary split"):
        dtensor_vocab_shard(distribute_tensor(weight, mesh, [Replicate()]))
    with pytest.raises(ValueError, match="only a vocabulary split"):
        dtensor_vocab_shard(distribute_tensor(weight, mesh, [Shard(1)]))
    with pytest.raises(ValueError, match="must be a DTensor"):
        dtensor_vocab_shard(weight)


def test_needs_a_process_group():
    import torch.distributed as dist

    from fused_ce_patch.vocab_parallel import vocab_parallel_linear_cross_entropy

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    hidden, weight, labels = _small()
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        vocab_parallel_linear_cross_entropy(hidden, weight, labels, vocab_start=0, vocab_size=7)

"""vocab_parallel_linear_token_stats on 2 CPU processes (gloo): every field (identical on both
ranks) and the gradients from random per-position upstream gradients on ``log_probs`` and
``entropy`` (the whole dH on every rank, each rank's dW / db shard put together) equal a
float64 reference from materialised logits and the single-device ``fused_linear_token_stats``
(relative 1e-10 for float64, 1e-5 for float32, 2e-2 for bfloat16), with softcap, logit
scale, temperature, shift, ignored labels, uneven and empty shards, tiles dividing nothing,
and an argmax tied across the two shards and within one (first-maximum rule).
Single-process checks (options, a world of one) at the end."""

from __future__ import annotations

import pytest
import torch

import vp_workers as w

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

RTOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 2e-2}
ALL = {"entropy": True, "accuracy": True, "mean_logits": True, "log_sum_sq_probs": True}
BASE = {"n": 26, "v": 37, "h": 8, "stats": True}  # torch.chunk shards: 19 + 18 columns
#: budgets (bytes of float64 / float32 tile cells: 32 / 16 bytes each)
ROWS12_F64 = 12 * 32  # 12 rows x 1 column: row chunks dividing nothing
COLS3_F64 = 3 * 26 * 32  # 26 rows x 3 columns: tiles that divide neither shard
ROWS12_F32 = 12 * 16

CASES = [
    {"name": "st_f64_all_tiles", **BASE, **ALL, "bias": True, "grad_entropy": True,
     "logits_budget": COLS3_F64},
    {"name": "st_f64_softcap_scale_temp_shift", **BASE, **ALL, "lead": (2, 13), "shift": True,
     "softcap": 5.0, "logit_scale": 0.7, "temperature": 0.8, "wscale": 3.0, "ignored": 0.2,
     "grad_entropy": True, "logits_budget": ROWS12_F64},
    {"name": "st_f64_log_probs_only_budget0", **BASE, "n": 30, "ignore_index": 5,
     "logits_budget": 0},
    {"name": "st_f64_entropy_grad_only_splits", **BASE, "entropy": True, "mean_logits": True,
     "splits": [30, 7], "grad_lp": False, "grad_entropy": True, "ignored": 0.3},
    {"name": "st_f64_empty_shard", **BASE, **ALL, "splits": [37, 0], "grad_entropy": True,
     "bias": True},
    {"name": "st_f64_tie_softcap", **BASE, **ALL, "bias": True, "tie": (3, 10, 30), "softcap": 4.0,
     "wscale": 0.5, "grad_entropy": True, "logits_budget": ROWS12_F64},
    {"name": "st_f64_all_ignored", **BASE, **ALL, "ignored": 1.0, "grad_entropy": True},
    {"name": "st_f32_all", **BASE, **ALL, "dtype": "float32", "softcap": 4.0,
     "logit_scale": 1.3, "temperature": 0.7, "bias": True, "ignored": 0.2, "wscale": 2.0,
     "grad_entropy": True, "logits_budget": ROWS12_F32},
    {"name": "st_f32_tie", **BASE, "accuracy": True, "dtype": "float32", "bias": True,
     "tie": (0, 36), "wscale": 0.5},
    {"name": "st_bf16_softcap", **BASE, **ALL, "dtype": "bfloat16", "softcap": 4.0,
     "bias": True, "ignored": 0.2, "grad_entropy": True, "logits_budget": ROWS12_F32},
]
REFUSED = {"name": "st_err_labels_differ", **BASE, "corrupt_rank": 1}
# one rank's labels differ with an equal checksum and one is out of range there: every rank
# raises (the count of such labels is in the fingerprint), none waits in a collective
COLLIDE = {"name": "st_err_out_of_range_on_one_rank", "n": 1000, "v": 37, "h": 4,
           "collide_rank": 1}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("vpstats")
    mp.spawn(w.worker, args=(2, str(out / "init"), [*CASES, REFUSED, COLLIDE], str(out)),
             nprocs=2)
    return out


def shifted(case, labels):
    ii = case.get("ignore_index", -100)
    if not case.get("shift"):
        return labels
    return torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], ii)], dim=-1)


def reference(case):
    """Every field and the gradients from materialised float64 logits (autograd)."""
    hidden, weight, bias, labels, up_lp, up_ent = w.stats_problem(case)
    h = hidden.double().requires_grad_(True)
    wt = weight.double().requires_grad_(True)
    b = None if bias is None else bias.double().requires_grad_(True)
    x = h @ wt.t() if b is None else h @ wt.t() + b
    z = x * case.get("logit_scale", 1.0)
    if case.get("softcap") is not None:
        z = case["softcap"] * torch.tanh(z / case["softcap"])
    z = (z / case.get("temperature", 1.0)).reshape(-1, case["v"])
    y = shifted(case, labels).reshape(-1)
    mask = y != case.get("ignore_index", -100)
    log_p = torch.log_softmax(z, dim=-1)
    zero = torch.zeros((), dtype=torch.float64)
    lp = torch.where(mask, log_p.gather(1, y.clamp(0).unsqueeze(1)).squeeze(1), zero)
    ent = torch.where(mask, -(log_p.exp() * log_p).sum(-1), zero)
    loss = zero.clone()
    if case.get("grad_lp", True):
        loss = loss + (lp * up_lp.reshape(-1)).sum()
    if case.get("grad_entropy"):
        loss = loss + (ent * up_ent.reshape(-1)).sum()
    loss.backward()
    with torch.no_grad():
        fields = {
            "log_probs": lp, "entropy": ent, "mask": mask,
            "is_top1": (z.argmax(-1) == y) & mask,
            "mean_logits": torch.where(mask, z.mean(-1), zero),
            "log_sum_sq_probs": torch.where(mask, torch.logsumexp(2 * log_p, -1), zero),
        }
    shape = labels.shape
    fields = {k: v.view(shape) for k, v in fields.items()}
    return fields, h.grad, wt.grad, None if b is None else b.grad


def single_device(case):
    """The same call of the single-device fused_linear_token_stats on the whole weight."""
    from fused_ce_patch import fused_linear_token_stats

    hidden, weight, bias, labels, up_lp, up_ent = w.stats_problem(case)
    hidden, weight = hidden.requires_grad_(True), weight.requires_grad_(True)
    if bias is not None:
        bias.requires_grad_(True)
    out = fused_linear_token_stats(hidden, weight, labels, bias=bias, **w.stats_options(case))
    loss = 0.0
    if case.get("grad_lp", True):
        loss = loss + (out.log_probs * up_lp.to(out.log_probs.dtype)).sum()
    if case.get("grad_entropy"):
        loss = loss + (out.entropy * up_ent.to(out.entropy.dtype)).sum()
    loss.backward()
    return out, hidden.grad, weight.grad, None if bias is None else bias.grad


def rel(a, b):
    b = b.double()
    denom = b.norm()
    diff = (a.double() - b).norm()
    return (diff / denom).item() if denom > 0 else diff.item()


def gathered(results, case):
    for r in range(2):
        err = results / f"{case['name']}.{r}.err"
        assert not err.exists(), err.read_text()
    return [torch.load(results / f"{case['name']}.{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_two_ranks_match_float64_reference_and_single_device(results, case):
    got = gathered(results, case)
    want, dh, dw, db = reference(case)
    one, one_dh, one_dw, one_db = single_device(case)
    dtype = case.get("dtype", "float64")
    tol = RTOL[dtype]
    for name in w.STATS_FIELDS:
        asked = name in ("log_probs", "mask") or case.get(
            "accuracy" if name == "is_top1" else name, False)
        for g in got:
            assert (g[name] is not None) == asked, name
            if asked:  # identical on every rank
                assert torch.equal(g[name], got[0][name]), name
        if not asked:
            assert getattr(one, name) is None
            continue
        mine = got[0][name]
        if mine.dtype == torch.bool:
            assert torch.equal(mine, want[name]), name
            assert torch.equal(mine, getattr(one, name)), name
        else:
            assert mine.dtype == (torch.float64 if dtype == "float64" else torch.float32)
            assert rel(mine, want[name]) <= tol, (name, rel(mine, want[name]))
            assert rel(mine, getattr(one, name)) <= tol, name
            assert not mine[~want["mask"]].any(), name  # ignored positions hold 0
    assert torch.equal(got[1]["dh"], got[0]["dh"])  # the whole dH on every rank
    for g in got:
        assert g["dw"].shape == (g["stop"] - g["start"], case["h"])
    grads = [(got[0]["dh"], dh, one_dh), (torch.cat([g["dw"] for g in got]), dw, one_dw)]
    if db is not None:
        grads.append((torch.cat([g["db"] for g in got]), db, one_db))
    for mine, ref, single in grads:
        assert rel(mine, ref) <= tol, rel(mine, ref)
        assert rel(mine, single) <= tol
    mask = want["mask"].reshape(-1)
    assert not got[0]["dh"].reshape(-1, case["h"])[~mask].any()  # no gradient when ignored
    if mask.any():
        assert got[0]["dh"].abs().sum() > 0 and got[0]["dw"].abs().sum() > 0
    else:
        assert not got[0]["dw"].any() and not got[0]["log_probs"].any()


@pytest.mark.parametrize("case", [c for c in CASES if "tie" in c], ids=lambda c: c["name"])
def test_argmax_tie_takes_the_first(results, case):
    """The ``tie`` columns (on both ranks; two of them in different tiles of rank 0 in the
    float64 case) share the maximum on most rows: the first counts, the others never."""
    got = gathered(results, case)
    want, *_ = reference(case)
    first, *later = case["tie"]
    assert first < got[0]["stop"] <= later[-1]  # the tie spans the two ranks
    labels = w.stats_problem(case)[3].reshape(-1)
    top1 = got[0]["is_top1"].reshape(-1)
    assert top1[labels == first].sum() >= 4
    for col in later:  # a later column loses every tie, and is never the maximum alone
        assert (labels == col).sum() >= 4 and not top1[labels == col].any(), col
    assert torch.equal(got[0]["is_top1"], want["is_top1"])


def test_ranks_that_disagree_raise(results):
    for r in range(2):  # every rank raises, none hangs
        err = results / f"{REFUSED['name']}.{r}.err"
        assert err.exists(), f"rank {r} did not raise"
        text = err.read_text()
        assert "ValueError" in text and "disagree on their labels" in text, text


def test_out_of_range_label_on_one_rank_raises_on_every_rank(results):
    for r in range(2):
        err = results / f"{COLLIDE['name']}.{r}.err"
        assert err.exists(), f"rank {r} did not raise"
        text = err.read_text()
        assert "LabelOutOfRangeError" in text and "outside [0, V)" in text, text


# -- single process ---------------------------------------------------------------------------


def _small(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 4, generator=g, dtype=dtype)
    weight = torch.randn(7, 4, generator=g, dtype=dtype)
    labels = torch.randint(0, 7, (5,), generator=g)
    return hidden, weight, labels


def test_world_of_one_equals_single_device(world_of_one):
    from fused_ce_patch import fused_linear_token_stats, vocab_parallel_linear_token_stats

    hidden, weight, labels = _small()
    labels[1] = -100
    opts = {"softcap": 3.0, "logit_scale": 0.5, "temperature": 1.5, **ALL}
    got = vocab_parallel_linear_token_stats(hidden, weight, labels, vocab_start=0,
                                            vocab_size=7, **opts)
    want = fused_linear_token_stats(hidden, weight, labels, backend="torch", **opts)
    for name in w.STATS_FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-12, atol=0)


@pytest.mark.parametrize("kwargs,error,words", [
    ({"softcap": True}, TypeError, "softcap"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"logit_scale": 0.0}, ValueError, "logit_scale"),
    ({"logit_scale": None}, TypeError, "logit_scale"),
    ({"temperature": 0.0}, ValueError, "temperature"),
    ({"temperature": "1"}, TypeError, "temperature"),
    ({"logits_budget": 1.5}, TypeError, "logits_budget"),
    ({"vocab_start": 1.0}, TypeError, "vocab_start"),
    ({"vocab_start": 3}, ValueError, "vocab_start"),
    ({"entropy": "no"}, TypeError, "entropy"),
    ({"accuracy": 1}, TypeError, "accuracy"),
    ({"shift": "no"}, TypeError, "shift"),
    ({"ignore_index": -100.0}, TypeError, "ignore_index"),
])
def test_bad_options_raise(world_of_one, kwargs, error, words):
    from fused_ce_patch import vocab_parallel_linear_token_stats

    hidden, weight, labels = _small()
    call = {"vocab_start": 0, "vocab_size": 7, **kwargs}
    with pytest.raises(error, match=words):
        vocab_parallel_linear_token_stats(hidden, weight, labels, **call)


def test_bad_tensors_raise(world_of_one):
    from fused_ce_patch import vocab_parallel_linear_token_stats as vp

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


def test_needs_a_process_group():
    import torch.distributed as dist

    from fused_ce_patch import vocab_parallel_linear_token_stats

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    hidden, weight, labels = _small()
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        vocab_parallel_linear_token_stats(hidden, weight, labels, vocab_start=0, vocab_size=7)

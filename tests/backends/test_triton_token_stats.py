"""fused_linear_token_stats on backend ``"triton"`` under the Triton interpreter (CPU tensors,
``TRITON_INTERPRET=1``): values and gradients against a float64 oracle, the forward-time
gradient of :class:`ForwardGradHint` and its fallback, ties, confident rows, the fallback to
tiles. ``tests/gpu/test_token_stats_gpu.py`` runs the same kernel at real sizes on CUDA.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA",
                allow_module_level=True)  # fmt: skip
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from interpreted import import_kernels  # noqa: E402

import_kernels()
from fused_ce_patch import ForwardGradHint, fused_linear_token_stats  # noqa: E402
from fused_ce_patch.backends.triton import token_stats as triton_stats  # noqa: E402
from fused_ce_patch.backends.triton.launch import RowKernelConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_token_stats import _oracle  # noqa: E402

V = 53


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(n=37, h=11, v=V, dtype=torch.float32, seed=0, ignored=0.3):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(n, h, generator=g) * 2).to(dtype).requires_grad_()
    w = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignored] = -100
    return hid, w, b, y


def _f64(*ts):
    return [t.detach().double().requires_grad_() for t in ts]


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _spy(monkeypatch):
    calls = []
    real = triton_stats.TritonTokenStats.apply

    def apply(*args):
        calls.append(args[7])
        return real(*args)

    monkeypatch.setattr(triton_stats.TritonTokenStats, "apply", apply)
    return calls


OPTS = [{}, {"softcap": 3.0}, {"logit_scale": 0.5, "softcap": 2.0, "temperature": 1.3},
        {"temperature": 0.7}]


def _row_config(monkeypatch, block_v, sub_rows, num_stages=1):
    """Launch the stats kernel with ``block_v`` columns a step in ``sub_rows`` segments (the
    CUDA launch's layout: 8 segments of 256; the interpreter's default is one segment);
    ``num_stages > 1`` takes the kernel's ``tl.range`` loops (CUDA's)."""
    if block_v is None:
        return
    cfg = RowKernelConfig(block_v=block_v, num_warps=4, num_stages=num_stages,
                          sub_rows=sub_rows)
    monkeypatch.setattr(triton_stats, "stats_kernel_config", lambda vocab, device, softcap: cfg)


#: (block_v, sub_rows[, num_stages]): the interpreter's default; V = 53 in 4 blocks of 4
#: segments, the last segments partly or wholly past V; one block of 8 segments, the last
#: one past V; one column a segment, with the pipelined loops
ROW_CONFIGS = [(None, 1), (16, 4), (64, 8), (32, 32, 2)]
ROW_IDS = ["default", "16x4", "64x8", "32x32-stages2"]


@pytest.mark.parametrize("row_config", ROW_CONFIGS, ids=ROW_IDS)
@pytest.mark.parametrize("opts", OPTS)
def test_float32_every_field_and_per_token_grads(opts, row_config, monkeypatch):
    _row_config(monkeypatch, *row_config)
    calls = _spy(monkeypatch)
    hid, w, b, y = _inputs()
    # 16 rows a chunk: 26 counted rows make 2 chunks (plan_rows evens them out)
    out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True, accuracy=True,
                                   mean_logits=True, log_sum_sq_probs=True,
                                   logits_budget=16 * V * 4, backend="triton", **opts)
    assert len(calls) == 1
    kw = {"softcap": opts.get("softcap"), "scale": opts.get("logit_scale", 1.0),
          "temperature": opts.get("temperature", 1.0)}
    h64, w64, b64 = _f64(hid, w, b)
    lp, ent, top1 = _oracle(h64, w64, b64, y, **kw)
    assert out.log_probs.dtype == torch.float32
    assert rel(out.log_probs, lp) < 1e-6 and rel(out.entropy, ent) < 1e-5
    assert torch.equal(out.is_top1, top1)
    x = h64 @ w64.t() + b64
    x = x * kw["scale"]
    if kw["softcap"]:
        x = kw["softcap"] * torch.tanh(x / kw["softcap"])
    z = x / kw["temperature"]
    mask = y != -100
    assert rel(out.mean_logits, z.mean(-1) * mask) < 1e-6
    p = torch.softmax(z, -1)
    assert rel(out.log_sum_sq_probs, torch.log((p * p).sum(-1)) * mask) < 1e-6
    g = torch.Generator().manual_seed(1)
    g_lp = torch.randn(y.shape[0], generator=g, dtype=torch.float64)
    g_ent = torch.randn(y.shape[0], generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum(),
                              (hid, w, b))
    want = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h64, w64, b64))
    for name, a, e in zip("HWb", got, want):
        assert rel(a, e) < 1e-5, name
    assert torch.all(got[0][~mask] == 0)


@pytest.mark.parametrize("row_config", ROW_CONFIGS, ids=ROW_IDS)
@pytest.mark.parametrize("opts", OPTS[:3])
def test_forward_grad_hint_uniform_upstream(opts, row_config, monkeypatch):
    _row_config(monkeypatch, *row_config)
    hid, w, b, y = _inputs(seed=2)
    hint = ForwardGradHint()
    out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True, accuracy=True,
                                   logits_budget=16 * V * 4, backend="triton",
                                   grad_hint=hint, **opts)
    kw = {"softcap": opts.get("softcap"), "scale": opts.get("logit_scale", 1.0),
          "temperature": opts.get("temperature", 1.0)}
    h64, w64, b64 = _f64(hid, w, b)
    lp, ent, _ = _oracle(h64, w64, b64, y, **kw)
    # the entropy of the one-launch schedule comes from the gradient pass
    assert rel(out.log_probs, lp) < 1e-6 and rel(out.entropy, ent) < 1e-5
    n_items = 7.0
    # SFT's loss: -sum(log p) / num_items, entropy only logged
    got = torch.autograd.grad(-out.log_probs.sum() / n_items + 0 * out.entropy.detach().sum(),
                              (hid, w, b))
    want = torch.autograd.grad(-lp.sum() / n_items, (h64, w64, b64))
    for name, a, e in zip("HWb", got, want):
        assert rel(a, e) < 1e-5, name
    assert hint.on


@pytest.mark.parametrize("row_config", ROW_CONFIGS[:2], ids=ROW_IDS[:2])
@pytest.mark.parametrize("upstream", ["per_token", "entropy"])
def test_forward_grad_hint_mismatch_recomputes_and_turns_off(upstream, row_config,
                                                             monkeypatch):  # fmt: skip
    _row_config(monkeypatch, *row_config)
    hid, w, b, y = _inputs(seed=3)
    hint = ForwardGradHint()
    h64, w64, b64 = _f64(hid, w, b)
    lp, ent, _ = _oracle(h64, w64, b64, y, softcap=3.0)
    g_lp = torch.linspace(-1, 2, y.shape[0], dtype=torch.float64)
    for _ in range(2):  # the second call goes straight to the recompute schedule
        out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True, softcap=3.0,
                                       logits_budget=16 * V * 4, backend="triton",
                                       grad_hint=hint)
        if upstream == "per_token":
            loss, ref = (out.log_probs * g_lp).sum(), (lp * g_lp).sum()
        else:
            loss, ref = -out.log_probs.mean() + 0.1 * out.entropy.sum(), \
                -lp.mean() + 0.1 * ent.sum()
        got = torch.autograd.grad(loss, (hid, w, b))
        want = torch.autograd.grad(ref, (h64, w64, b64), retain_graph=True)
        for name, a, e in zip("HWb", got, want):
            assert rel(a, e) < 1e-5, name
        assert not hint.on


@pytest.mark.parametrize("row_config", ROW_CONFIGS[:2], ids=ROW_IDS[:2])
def test_hint_entropy_gradient_as_accurate_as_without(row_config, monkeypatch):
    # With a hint the first call's entropy comes from the gradient pass; an entropy gradient
    # then recomputes with it: -p (log p + H) cancels for near-uniform rows (small logit
    # scale), where log_s must cancel between log p and H as it does without the hint
    _row_config(monkeypatch, *row_config)
    hid, w, b, y = _inputs(n=20, h=7, seed=100)
    g_ent = torch.randn(y.shape[0], generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
    h64, w64, b64 = _f64(hid, w, b)
    _, ent, _ = _oracle(h64, w64, b64, y, scale=1e-3)
    want = torch.autograd.grad((ent * g_ent).sum(), (h64, w64, b64))
    errs = {}
    for hint in (ForwardGradHint(), None):
        out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True, logit_scale=1e-3,
                                       logits_budget=16 * V * 4, backend="triton",
                                       grad_hint=hint)
        got = torch.autograd.grad((out.entropy * g_ent).sum(), (hid, w, b))
        errs[hint is None] = [rel(a, e) for a, e in zip(got, want)]
    for with_hint, without in zip(errs[False], errs[True]):
        assert with_hint <= 1.5 * without + 1e-7, errs


def test_forward_grad_hint_partial_needs():
    hid, w, b, y = _inputs(seed=4)
    w.requires_grad_(False)
    hint = ForwardGradHint()
    out = fused_linear_token_stats(hid, w, y, bias=b, logits_budget=16 * V * 4,
                                   backend="triton", grad_hint=hint)
    dh, db = torch.autograd.grad(out.log_probs.sum() * 3.0, (hid, b))
    h64, w64, b64 = _f64(hid, w, b)
    lp, _, _ = _oracle(h64, w64, b64, y)
    want = torch.autograd.grad(lp.sum() * 3.0, (h64, b64))
    assert rel(dh, want[0]) < 1e-5 and rel(db, want[1]) < 1e-5


@pytest.mark.parametrize("row_config", ROW_CONFIGS[:2], ids=ROW_IDS[:2])
@pytest.mark.parametrize("hint", [None, ForwardGradHint()])
def test_bfloat16_no_worse_than_the_torch_path(hint, row_config, monkeypatch):
    _row_config(monkeypatch, *row_config)
    hid, w, _, y = _inputs(dtype=torch.bfloat16, seed=5)
    h64, w64 = _f64(hid, w)
    # values against the bf16-rounded logits (as lm_head(hidden) rounds them), gradients
    # against float64
    lp, ent, _ = _oracle(hid.detach(), w.detach(), None, y)
    lp64, _, _ = _oracle(h64, w64, None, y)
    want = torch.autograd.grad(-lp64.sum(), (h64, w64))
    errs = {}
    for backend in ("triton", "torch"):
        out = fused_linear_token_stats(hid, w, y, entropy=True, logits_budget=16 * V * 2,
                                       backend=backend,
                                       grad_hint=hint if backend == "triton" else None)
        got = torch.autograd.grad(-out.log_probs.sum(), (hid, w))
        errs[backend] = [rel(out.log_probs, lp), rel(out.entropy, ent)] + [
            rel(a, e) for a, e in zip(got, want)]
    for i, (ours, torch_path) in enumerate(zip(errs["triton"], errs["torch"])):
        assert ours <= 1.5 * torch_path + 1e-6, (i, errs)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("row_config", [(None, 1), (1024, 8)], ids=["default", "1024x8"])
def test_is_top1_first_maximum_on_ties(row_config, softcap, monkeypatch):
    _row_config(monkeypatch, *row_config)
    # columns 0, 1, 1500 tie for the maximum in every row; V spans several row-kernel blocks
    # (with 8 segments of 128: 1500 is in block 1, segment 3)
    v = 2100
    w = torch.zeros(v, 1)
    w[0] = w[1] = w[1500] = 1.0
    h = torch.ones(3, 1)
    y = torch.tensor([0, 1, 1500])
    out = fused_linear_token_stats(h, w, y, accuracy=True, softcap=softcap, backend="triton")
    assert out.is_top1.tolist() == [True, False, False]
    # a tie within one block across segments: the lower column (segment 0) wins
    w = torch.zeros(v, 1)
    w[200] = w[100] = 1.0
    out = fused_linear_token_stats(h[:2], w, torch.tensor([100, 200]), accuracy=True,
                                   softcap=softcap, backend="triton")
    assert out.is_top1.tolist() == [True, False]
    # a target below the maximum, and one just above a column one ulp of x below it
    w[300] = 1.5
    w[400] = torch.nextafter(torch.tensor(1.5), torch.tensor(0.0))
    out = fused_linear_token_stats(h[:2], w, torch.tensor([100, 300]), accuracy=True,
                                   softcap=softcap, backend="triton")
    assert out.is_top1.tolist() == [False, True]


def test_confident_rows_keep_their_gradient():
    # p_y ~ 1 - 1e-6: 1 - p_y comes from -expm1(-nll), not 1 - exp(-nll) in float32, so the
    # error stays below PyTorch's own float32 log_softmax backward (which forms 1 - p_y)
    h = torch.tensor([[1.0], [1.0]], requires_grad=True)
    w = torch.tensor([[16.0], [0.0], [2.0]], requires_grad=True)
    y = torch.tensor([0, 2])
    out = fused_linear_token_stats(h, w, y, backend="triton")
    got = torch.autograd.grad(out.log_probs.sum(), (h, w))

    def plain(hh, ww):
        return torch.log_softmax(hh @ ww.t(), -1).gather(1, y.unsqueeze(1)).sum()

    h64, w64 = _f64(h, w)
    want = torch.autograd.grad(plain(h64, w64), (h64, w64))
    h32, w32 = [t.detach().clone().requires_grad_() for t in (h, w)]
    torch32 = torch.autograd.grad(plain(h32, w32), (h32, w32))
    for a, base, e in zip(got, torch32, want):
        assert rel(a[0], e[0]) <= rel(base[0], e[0]) and rel(a[0], e[0]) < 0.03


def test_small_budget_falls_back_to_tiles(monkeypatch):
    calls = _spy(monkeypatch)
    hid, w, b, y = _inputs(seed=6)
    out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True,
                                   logits_budget=4 * V * 4, backend="triton")
    assert calls == []  # fewer than 16 rows fit: the tiled torch algorithm ran
    h64, w64, b64 = _f64(hid, w, b)
    assert rel(out.log_probs, _oracle(h64, w64, b64, y)[0]) < 1e-6


def test_no_grad_and_all_ignored():
    hid, w, b, y = _inputs(seed=7)
    with torch.no_grad():
        out = fused_linear_token_stats(hid, w, y, bias=b, backend="triton",
                                       grad_hint=ForwardGradHint())
    assert not out.log_probs.requires_grad
    y[:] = -100
    out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True, backend="triton")
    assert torch.all(out.log_probs == 0)
    out.log_probs.sum().backward()
    assert torch.all(hid.grad == 0)
    assert math.isfinite(float(w.grad.abs().sum()))


def test_strided_labels():
    # a label column of a wider tensor (stride 2) and an expanded label (stride 0)
    g = torch.Generator().manual_seed(8)
    h = torch.randn(8, 4, generator=g, requires_grad=True)
    w = torch.randn(16, 4, generator=g, requires_grad=True)
    for y in (torch.randint(0, 16, (8, 2), generator=g)[:, 0], torch.tensor(3).expand(8)):
        out = fused_linear_token_stats(h, w, y, accuracy=True, backend="triton")
        h64, w64 = _f64(h, w)
        lp, _, top1 = _oracle(h64, w64, None, y)
        assert rel(out.log_probs, lp) < 1e-6 and torch.equal(out.is_top1, top1)
        got = torch.autograd.grad(out.log_probs.sum(), (h, w))
        want = torch.autograd.grad(lp.sum(), (h64, w64))
        assert all(rel(a, e) < 1e-5 for a, e in zip(got, want))


def test_hint_without_grad_mode_forms_no_gradient(monkeypatch):
    formed = []
    real = triton_stats._backprop_chunk
    monkeypatch.setattr(triton_stats, "_backprop_chunk",
                        lambda *a, **k: (formed.append(1), real(*a, **k))[1])
    hid, w, b, y = _inputs(seed=9)
    hint = ForwardGradHint()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            fused_linear_token_stats(hid, w, y, bias=b, backend="triton", grad_hint=hint)
    assert formed == [] and hint.on


# --- the column-tiled recompute backward (triton_stats._grad_pass_columns) -----------------

def _column_plan(monkeypatch, rows, cols):
    """Force the recompute backward onto column tiles of ``rows`` x ``cols``; returns the
    list of plans it ran with (one per backward)."""
    ran = []

    def plan(*_args):
        ran.append(triton_stats.ColumnPlan(rows, cols))
        return ran[-1]

    monkeypatch.setattr(triton_stats, "plan_columns", plan)
    return ran


#: (rows a group, columns a tile): one group, 4 tiles (the last 5 of V = 53 columns); three
#: groups of 9 (dW added by later groups) by 16; one column a tile; one tile of all columns
COLUMN_PLANS = [(64, 16), (9, 16), (40, 1), (26, 53)]


# One column a tile (40x1) launches 53 tiles per group: ~30-60 s each in the interpreter, slow.
@pytest.mark.parametrize("plan", [pytest.param(p, marks=pytest.mark.slow) if p[1] == 1 else p
                                  for p in COLUMN_PLANS],
                         ids=[f"{r}x{c}" for r, c in COLUMN_PLANS])
@pytest.mark.parametrize("row_config", ROW_CONFIGS[:3], ids=ROW_IDS[:3])
@pytest.mark.parametrize("opts", OPTS[:3])
def test_column_tiled_backward_per_token_grads(opts, row_config, plan, monkeypatch):
    _row_config(monkeypatch, *row_config)
    ran = _column_plan(monkeypatch, *plan)
    hid, w, b, y = _inputs(seed=11)
    out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True, logits_budget=16 * V * 4,
                                   backend="triton", **opts)
    kw = {"softcap": opts.get("softcap"), "scale": opts.get("logit_scale", 1.0),
          "temperature": opts.get("temperature", 1.0)}
    h64, w64, b64 = _f64(hid, w, b)
    lp, ent, _ = _oracle(h64, w64, b64, y, **kw)
    g = torch.Generator().manual_seed(12)
    g_lp = torch.randn(y.shape[0], generator=g, dtype=torch.float64)
    g_ent = torch.randn(y.shape[0], generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum(),
                              (hid, w, b))
    want = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h64, w64, b64))
    assert len(ran) == 1
    for name, a, e in zip("HWb", got, want):
        assert rel(a, e) < 1e-5, name
    assert torch.all(got[0][y == -100] == 0)


@pytest.mark.parametrize("upstream", ["log_probs", "entropy"])
def test_column_tiled_backward_partial_needs(upstream, monkeypatch):
    # frozen weight, no bias; one upstream gradient absent
    ran = _column_plan(monkeypatch, 9, 16)
    hid, w, _, y = _inputs(seed=13)
    w.requires_grad_(False)
    out = fused_linear_token_stats(hid, w, y, entropy=True, softcap=3.0,
                                   logits_budget=16 * V * 4, backend="triton")
    h64, w64 = _f64(hid, w)
    lp, ent, _ = _oracle(h64, w64, None, y, softcap=3.0)
    g_tok = torch.linspace(-1, 2, y.shape[0], dtype=torch.float64)
    got_out, ref_out = (out.log_probs, lp) if upstream == "log_probs" else (out.entropy, ent)
    (dh,) = torch.autograd.grad((got_out * g_tok).sum(), (hid,))
    (want,) = torch.autograd.grad((ref_out * g_tok).sum(), (h64,))
    assert len(ran) == 1 and rel(dh, want) < 1e-5


@pytest.mark.parametrize("hint", [None, ForwardGradHint()])
def test_column_tiled_backward_bfloat16_no_worse_than_row_chunks(hint, monkeypatch):
    # per-token weights (the recompute schedule); the hint, if any, is dropped at the first
    # backward and the gradient recomputed on column tiles
    hid, w, b, y = _inputs(dtype=torch.bfloat16, seed=14)
    h64, w64, b64 = _f64(hid, w, b)
    lp64, ent64, _ = _oracle(h64, w64, b64, y)
    g_lp = torch.linspace(-1, 2, y.shape[0], dtype=torch.float64)
    want = torch.autograd.grad((lp64 * g_lp).sum() + 0.1 * ent64.sum(), (h64, w64, b64))
    errs = {}
    for tiled in (False, True):
        with monkeypatch.context() as m:
            ran = _column_plan(m, 9, 16) if tiled else []
            if not tiled:
                m.setattr(triton_stats, "plan_columns", lambda *a: None)
            out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True,
                                           logits_budget=16 * V * 2, backend="triton",
                                           grad_hint=hint)
            got = torch.autograd.grad((out.log_probs * g_lp.float()).sum()
                                      + 0.1 * out.entropy.sum(), (hid, w, b))
        assert len(ran) == int(tiled)
        errs[tiled] = [rel(a, e) for a, e in zip(got, want)]
    for tiled, rows in zip(errs[True], errs[False]):
        assert tiled <= 1.25 * rows + 1e-6, errs


def test_plan_columns_bounds():
    plan_columns = triton_stats.plan_columns
    MiB = 2**20
    # (M, H, V): Llama-3, Gemma-2, Qwen2.5, Llama-2 at 8K tokens (90 % counted), Gemma-3 at 32K
    for m, h, v in [(7373, 4096, 128256), (7373, 2304, 256000), (7373, 3584, 152064),
                    (7373, 4096, 32000), (29491, 640, 262144)]:
        for budget in (64 * MiB, 256 * MiB, 512 * MiB):
            p = plan_columns(m, h, v, 2, budget)
            chunk_rows = budget // (v * 2)
            if p is None:
                continue
            assert p.rows * p.cols * 2 + 4 * p.rows * h <= budget  # logits tile + dH acc
            assert 4 * p.rows * h <= budget // 2
            assert p.rows >= triton_stats.COL_MIN_ROW_GAIN * chunk_rows
            assert p.rows <= triton_stats.COL_GROUP_ROWS
            assert min(v, triton_stats.COL_MIN_COLS) <= p.cols <= v
            assert p.cols % 8 == 0 or p.cols == v
            _assert_even(m, v, p)
    # the shapes that motivate it take it; Llama-2's two row chunks do as well as tiles
    assert plan_columns(7373, 2304, 256000, 2, 256 * MiB) is not None
    assert plan_columns(29491, 640, 262144, 2, 256 * MiB) is not None
    assert plan_columns(7373, 4096, 32000, 2, 256 * MiB) is None
    # the last tile is not a sliver where rounding to 8 columns would leave one (a review's
    # cases: 18 tiles of 2792 and one of 1 column; 1776-column tiles and a last one of 32)
    for m, h, v in [(4392, 512, 50257), (11958, 512, 32000)]:
        p = plan_columns(m, h, v, 2, 32 * MiB)
        assert p is not None and p.rows * p.cols * 2 + 4 * p.rows * h <= 32 * MiB
        _assert_even(m, v, p)
    # 16-bit inputs only (float32's recompute would not repeat forward's logits bit for bit)
    assert plan_columns(7373, 2304, 256000, 4, 256 * MiB) is None
    # tiny budgets and shapes: never a tile the budget cannot hold
    for m, h, v, budget in [(1, 1, 1, 1), (26, 11, 53, 16 * 53 * 4), (5, 3, 7, 10**6),
                            (100, 8, 2000, 10**5), (0, 8, 100, 10**6), (10, 0, 100, 10**6)]:
        p = plan_columns(m, h, v, 2, budget)
        assert p is None or (p.rows * p.cols * 2 + 4 * p.rows * h <= budget
                             and p.rows >= 1 and p.cols >= 1)


def _assert_even(m, v, p):
    """Groups and tiles (nearly) even: the last of each holds more than half of the others."""
    last_group = m - (-(-m // p.rows) - 1) * p.rows
    last_tile = v - (-(-v // p.cols) - 1) * p.cols
    assert last_group > p.rows // 2 or m <= p.rows, (m, p)
    assert last_tile > p.cols // 2 or v <= p.cols, (v, p)


def test_column_tiled_backward_no_counted_rows(monkeypatch):
    ran = _column_plan(monkeypatch, 9, 16)
    hid, w, b, y = _inputs(seed=15)
    y[:] = -100
    out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True, logits_budget=16 * V * 4,
                                   backend="triton")
    dh, dw, db = torch.autograd.grad((out.log_probs * 2.0).sum() + out.entropy.sum(),
                                     (hid, w, b))
    assert len(ran) == 1
    assert torch.all(dh == 0) and torch.all(dw == 0) and torch.all(db == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_column_tiles_taken_for_16_bit_inputs_only(dtype, monkeypatch):
    # the real plan, its thresholds lowered to these sizes: float32 keeps the row chunks
    monkeypatch.setattr(triton_stats, "COL_MIN_ROW_GAIN", 0)
    monkeypatch.setattr(triton_stats, "COL_MIN_COLS", 1)
    ran, real = [], triton_stats._grad_pass_columns
    monkeypatch.setattr(triton_stats, "_grad_pass_columns",
                        lambda *a, **k: (ran.append(a[5]), real(*a, **k))[1])
    hid, w, _, y = _inputs(n=40, h=16, dtype=dtype, seed=16, ignored=0.1)
    out = fused_linear_token_stats(hid, w, y, logits_budget=2000,
                                   backend="triton")
    g_lp = torch.linspace(-1, 2, y.shape[0])
    dh, dw = torch.autograd.grad((out.log_probs * g_lp).sum(), (hid, w))
    h64, w64 = _f64(hid, w)
    lp, _, _ = _oracle(h64, w64, None, y)
    want = torch.autograd.grad((lp * g_lp.double()).sum(), (h64, w64))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel(dh, want[0]) < tol and rel(dw, want[1]) < tol
    if dtype == torch.float32:
        assert ran == []
    else:
        assert len(ran) == 1 and ran[0].cols < V and ran[0].rows < 36, ran  # 3 x 2 tiles

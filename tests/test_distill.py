"""fused_linear_jsd: the generalized JSD of GKD from hidden states, against a float64
materialised reference and against TRL's own ``generalized_jsd_loss``.

Tolerances (relative error of the whole tensor, ‖a−b‖/‖b‖):
- loss: the matmuls sum exact products (16-bit operands) in float32, the rest is float32:
  a few float32 ulps per term, 2e-5 for any input dtype.
- gradients, float32 inputs: 2e-5 (float32 throughout).
- gradients, bfloat16 inputs: dz is rounded once to bf16 for the dH/dW matmuls, and dH/dW
  once more to bf16 (2**-9 relative each): 2**-7.
"""

from __future__ import annotations

import importlib.util
import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_ce_patch
from fused_ce_patch import fused_linear_jsd

HAS_TRL = importlib.util.find_spec("trl") is not None


def _trl_gkd():
    """TRL's GKDTrainer, imported at first use: importing trl imports triton, and a triton
    imported before ``TRITON_INTERPRET=1`` is set breaks the interpreter tests collected
    after this file (tests/backends/interpreted.py)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
    return GKDTrainer

LOSS_TOL = 2e-5
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 2.0**-7}
BETAS = (0.0, 0.5, 1.0, 0.3)
REDUCTIONS = ("batchmean", "sum", "mean", "none")


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def reference_jsd(zs, zt, labels, beta, temperature, reduction, num_items=None,
                  ignore_index=-100):
    """Plain float64 GKD Eq. 1 on materialised logits, written from the definition
    (probabilities, not TRL's kl_div calls); TRL's reductions."""
    zs, zt = zs.double() / temperature, zt.double() / temperature
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    ps, pt = ls.exp(), lt.exp()
    if beta == 0:
        d = (pt * (lt - ls)).sum(-1)
    elif beta == 1:
        d = (ps * (ls - lt)).sum(-1)
    else:
        m = (1 - beta) * ps + beta * pt
        d = beta * (pt * (lt - m.log())).sum(-1) + (1 - beta) * (ps * (ls - m.log())).sum(-1)
    lead0 = zs.shape[0]
    if labels is not None:
        mask = labels != ignore_index
        d = d * mask
        count = int(mask.sum())
    else:
        count = d.numel()
    if num_items is not None:
        return d.sum() / num_items
    if reduction == "none":
        return d
    if reduction == "sum":
        return d.sum()
    if reduction == "batchmean":
        return d.sum() / (max(count, 1) if labels is not None else max(lead0, 1))
    return d.sum() / (count * zs.shape[-1])


def _inputs(lead=(2, 7), hs_size=16, ht_size=24, vocab=53, dtype=torch.float32, seed=0,
            bias=False, ignored=True, teacher_grad=False, scale=2.0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * s).to(dtype)

    hs = r(*lead, hs_size).requires_grad_()
    ws = r(vocab, hs_size, s=scale / math.sqrt(hs_size)).requires_grad_()
    ht = r(*lead, ht_size).requires_grad_(teacher_grad)
    wt = r(vocab, ht_size, s=scale / math.sqrt(ht_size)).requires_grad_(teacher_grad)
    bs = r(vocab, s=0.5).requires_grad_() if bias else None
    bt = r(vocab, s=0.5).requires_grad_(teacher_grad) if bias else None
    labels = torch.randint(0, vocab, lead, generator=g)
    if ignored:
        labels[torch.rand(lead, generator=g) < 0.3] = -100
        labels.view(-1)[0] = -100
    return hs, ws, bs, ht, wt, bt, labels


def _logits64(h, w, b):
    z = h.double() @ w.double().t()
    return z if b is None else z + b.double()


def _leaves(hs, ws, bs, ht, wt, bt):
    return [t for t in (hs, ws, bs, ht, wt, bt) if t is not None and t.requires_grad]


def _check(dtype, lead, beta, temperature, reduction, ignored, bias=False, teacher_grad=False,
           num_items=None, budget=None, hs_size=16, ht_size=24, vocab=53):
    hs, ws, bs, ht, wt, bt, labels = _inputs(lead, hs_size, ht_size, vocab, dtype, bias=bias,
                                             ignored=ignored, teacher_grad=teacher_grad)
    lab = labels if ignored else None
    got = fused_linear_jsd(hs, ws, ht, wt, lab, beta=beta, temperature=temperature,
                           reduction=reduction, num_items_in_batch=num_items,
                           student_bias=bs, teacher_bias=bt, logits_budget=budget)
    leaves = _leaves(hs, ws, bs, ht, wt, bt)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_map = dict(zip(map(id, leaves), ref_leaves))

    def m(t):
        return None if t is None else ref_map.get(id(t), t.detach().double())

    want = reference_jsd(_logits64(m(hs), m(ws), m(bs)), _logits64(m(ht), m(wt), m(bt)), lab,
                         beta, temperature, reduction, num_items)
    assert got.dtype == torch.float32
    assert got.shape == want.shape
    if want.dim() == 0 and not torch.isfinite(want):
        assert torch.isnan(got) and torch.isnan(want)
        return
    assert rel(got, want) < LOSS_TOL
    # a non-uniform upstream gradient for per-position results
    up = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).view(want.shape)
    grads = torch.autograd.grad((got * up.float()).sum(), leaves)
    ref_grads = torch.autograd.grad((want * up).sum(), ref_leaves)
    for t, a, b in zip(leaves, grads, ref_grads):
        assert a.dtype == t.dtype and a.shape == t.shape
        assert rel(a, b) < GRAD_TOL[dtype], (tuple(t.shape), rel(a, b))


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignored", [True, False])
def test_float32_3d_vs_float64(beta, temperature, reduction, ignored):
    _check(torch.float32, (2, 7), beta, temperature, reduction, ignored, budget=3000)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_bfloat16_2d_vs_float64(beta, reduction):
    _check(torch.bfloat16, (19,), beta, 2.0, reduction, True, budget=5000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", BETAS)
def test_biases_teacher_grad_many_chunks(dtype, beta):
    # budget of one row: 14 chunks of 1 row; and a budget leaving an uneven last chunk
    for budget in (1, 53 * 4 * 7 * 3):
        _check(dtype, (2, 7), beta, 1.0, "batchmean", True, bias=True, teacher_grad=True,
               budget=budget)


@pytest.mark.parametrize("num_items", [5, torch.tensor(7.0)])
@pytest.mark.parametrize("reduction", ["batchmean", "none"])
def test_num_items_in_batch(num_items, reduction):
    _check(torch.float32, (2, 7), 0.5, 1.0, reduction, True, num_items=num_items,
           teacher_grad=True)


def test_mean_with_nothing_counted_is_nan_like_trl():
    hs, ws, _, ht, wt, _, labels = _inputs()
    labels.fill_(-100)
    out = fused_linear_jsd(hs, ws, ht, wt, labels, reduction="mean")
    assert torch.isnan(out)
    out = fused_linear_jsd(hs, ws, ht, wt, labels, reduction="batchmean")
    assert out.item() == 0.0
    out.backward()
    assert hs.grad.abs().sum() == 0 and ws.grad.abs().sum() == 0


@pytest.mark.skipif(not HAS_TRL, reason="trl not installed")
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignored", [True, False])
@pytest.mark.parametrize("num_items", [None, 9])
def test_equals_trl_generalized_jsd(beta, temperature, reduction, ignored, num_items):
    """TRL's own function on the materialised logits (float64 inputs: only the arithmetic
    order differs)."""
    hs, ws, bs, ht, wt, bt, labels = _inputs(dtype=torch.float64, bias=True,
                                             ignored=ignored, teacher_grad=True)
    lab = labels if ignored else None
    got = fused_linear_jsd(hs, ws, ht, wt, lab, beta=beta, temperature=temperature,
                           reduction=reduction, num_items_in_batch=num_items,
                           student_bias=bs, teacher_bias=bt, logits_budget=2000)
    want = _trl_gkd().generalized_jsd_loss(_logits64(hs, ws, bs), _logits64(ht, wt, bt), lab,
                                           beta=beta, temperature=temperature,
                                           reduction=reduction, num_items_in_batch=num_items)
    if reduction == "none" and num_items is None:
        # TRL's "none" is elementwise [counted, V] (or [B, T, V]); ours per position
        want = want.sum(-1)
        got = got[labels != -100] if ignored else got
    if want.dim() == 0 and torch.isnan(want):
        assert torch.isnan(got)
        return
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    leaves = [hs, ws, bs, ht, wt, bt]
    ga = torch.autograd.grad(got.sum(), leaves)
    gb = torch.autograd.grad(want.sum(), leaves)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


@pytest.mark.skipif(not HAS_TRL, reason="trl not installed")
def test_float32_3d_vs_trl_differing_hidden_sizes():
    hs, ws, _, ht, wt, _, labels = _inputs(lead=(3, 5), hs_size=8, ht_size=40)
    got = fused_linear_jsd(hs, ws, ht, wt, labels, beta=0.5, logits_budget=700)
    want = _trl_gkd().generalized_jsd_loss(_logits64(hs, ws, None), _logits64(ht, wt, None),
                                           labels, beta=0.5)
    assert rel(got, want) < LOSS_TOL


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_logit_scale_and_softcap(beta):
    hs, ws, bs, ht, wt, bt, labels = _inputs(dtype=torch.float64, teacher_grad=True,
                                             scale=8.0)
    kw = dict(student_logit_scale=0.7, teacher_logit_scale=1.3, student_softcap=5.0,
              teacher_softcap=3.0)
    got = fused_linear_jsd(hs, ws, ht, wt, labels, beta=beta, temperature=2.0,
                           logits_budget=500, **kw)
    zs = 5.0 * torch.tanh(0.7 * _logits64(hs, ws, None) / 5.0)
    zt = 3.0 * torch.tanh(1.3 * _logits64(ht, wt, None) / 3.0)
    want = reference_jsd(zs, zt, labels, beta, 2.0, "batchmean")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    leaves = [hs, ws, ht, wt]
    for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_student_entropy():
    hs, ws, _, ht, wt, _, labels = _inputs(dtype=torch.float64)
    loss, ent = fused_linear_jsd(hs, ws, ht, wt, labels, temperature=2.0,
                                 return_student_entropy=True, logits_budget=900)
    ls = (_logits64(hs, ws, None) / 2.0).log_softmax(-1)
    want = -(ls.exp() * ls).sum(-1) * (labels != -100)
    assert ent.shape == labels.shape and not ent.requires_grad
    torch.testing.assert_close(ent, want, rtol=1e-12, atol=1e-14)


def test_retained_graph_second_backward_is_the_same():
    hs, ws, _, ht, wt, _, labels = _inputs(teacher_grad=True)
    loss = fused_linear_jsd(hs, ws, ht, wt, labels, logits_budget=2000)
    g1 = torch.autograd.grad(loss, [hs, ws, ht, wt], retain_graph=True)
    g2 = torch.autograd.grad(loss * 3.0, [hs, ws, ht, wt])
    for a, b in zip(g1, g2):  # the replay scales dz before the matmuls: float32 reordering
        assert rel(3.0 * a, b) < 1e-6


def test_float16_forms_gradient_at_upstream_scale():
    hs, ws, _, ht, wt, _, labels = _inputs(dtype=torch.float16)
    loss = fused_linear_jsd(hs, ws, ht, wt, labels, reduction="sum")
    (g,) = torch.autograd.grad(loss * 1024.0, [hs])
    ref = [t.detach().double().requires_grad_() for t in (hs, ws)]
    want = reference_jsd(_logits64(*ref, None), _logits64(ht.detach(), wt.detach(), None),
                         labels, 0.5, 1.0, "sum")
    (gw,) = torch.autograd.grad(want * 1024.0, [ref[0]])
    assert rel(g, gw) < 2.0**-8


def test_exported():
    assert "fused_linear_jsd" in fused_ce_patch.__all__
    assert fused_ce_patch.fused_linear_jsd is fused_linear_jsd


class _Shapes(TorchDispatchMode):
    """Shapes of every tensor an op returns inside the mode."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["batchmean", "none"])
def test_no_n_by_v_tensor(dtype, reduction):
    """Forward and backward never produce a tensor of more than one chunk's rows of logits
    (here 4 rows of V = 97; N = 256), let alone [N, V]."""
    n, vocab = 256, 97
    hs, ws, _, ht, wt, _, labels = _inputs(lead=(n,), hs_size=8, ht_size=8, vocab=vocab,
                                           dtype=dtype, teacher_grad=True, ignored=False)
    budget = 4 * vocab * 32  # 4 rows at the torch kernel's <= 32 bytes per column
    with _Shapes() as rec:
        loss = fused_linear_jsd(hs, ws, ht, wt, labels, reduction=reduction,
                                logits_budget=budget)
        loss.sum().backward()
    with_vocab = [s for s in rec.shapes if vocab in s and 8 not in s]
    assert with_vocab, "the watcher saw no logits at all"
    biggest = max(math.prod(s) for s in with_vocab)
    assert biggest <= 4 * vocab, max(with_vocab, key=math.prod)
    assert all(math.prod(s) < n * vocab // 8 for s in rec.shapes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("teacher_grad", [False, True])
def test_torch_path_live_logits_stay_within_the_budget(dtype, beta, softcap, teacher_grad):
    """Peak bytes of live logits-shaped tensors over forward + backward are at most
    ``logits_budget`` (the budget holds 4 rows at the options' own cost per column)."""
    from fused_ce_patch.backends.distill_chunked import DivergenceSpec, TorchDivergenceKernel
    from test_tile_policy import LogitsWatcher

    n, h, vocab = 64, 8, 97
    hs, ws, _, ht, wt, _, _ = _inputs(lead=(n,), hs_size=h, ht_size=h, vocab=vocab,
                                      dtype=dtype, teacher_grad=teacher_grad, ignored=False)
    spec = DivergenceSpec(beta=beta, student_softcap=softcap, teacher_softcap=softcap)
    per_col = TorchDivergenceKernel().bytes_per_column(dtype, dtype, spec, teacher_grad)
    budget = 4 * vocab * per_col
    watcher = LogitsWatcher(h, (hs, ws, ht, wt))
    with watcher:
        loss = fused_linear_jsd(hs, ws, ht, wt, beta=beta, student_softcap=softcap,
                                teacher_softcap=softcap, logits_budget=budget, backend="torch")
        loss.backward()
    assert watcher.largest_shape[-1] == vocab  # it saw the logits
    assert watcher.peak <= budget, (watcher.peak, budget)
    assert watcher.peak >= budget // 2  # and the count is not loose


def test_the_watcher_sees_materialised_logits():
    # the check above fails for the materialised computation
    hs, ws, _, ht, wt, _, labels = _inputs(lead=(256,), hs_size=8, ht_size=8, vocab=97)
    with _Shapes() as rec:
        GKD = reference_jsd(_logits64(hs, ws, None), _logits64(ht, wt, None), labels, 0.5,
                            1.0, "sum")
        GKD.backward()
    assert any(math.prod(s) >= 256 * 97 for s in rec.shapes)


# ---- bad input ------------------------------------------------------------------------


def _bad(**over):
    hs, ws, _, ht, wt, _, labels = _inputs()
    args = dict(student_hidden=hs, student_weight=ws, teacher_hidden=ht, teacher_weight=wt,
                labels=labels)
    args.update(over)
    return args


@pytest.mark.parametrize("over, exc, match", [
    (dict(teacher_weight=torch.randn(54, 24)), ValueError, "vocabulary sizes differ"),
    (dict(beta=1.5), ValueError, r"beta must be in \[0, 1\]"),
    (dict(beta=-0.1), ValueError, r"beta must be in \[0, 1\]"),
    (dict(temperature=0.0), ValueError, "temperature must be"),
    (dict(temperature=-1.0), ValueError, "temperature must be"),
    (dict(labels=torch.zeros(2, 6, dtype=torch.long)), ValueError, "labels shape"),
    (dict(labels=torch.zeros(2, 7)), TypeError, "labels must be an integer tensor"),
    (dict(student_weight=torch.randn(53, 15)), ValueError, "student_hidden's last dimension"),
    (dict(teacher_weight=torch.randn(53, 16)), ValueError, "teacher_hidden's last dimension"),
    (dict(teacher_hidden=torch.randn(2, 6, 24)), ValueError, "same leading shape"),
    (dict(reduction="avg"), ValueError, "unknown reduction"),
    (dict(student_weight=torch.randn(53, 16, dtype=torch.float64)), TypeError, "student_hidden is"),
    (dict(logits_budget=-1), ValueError, "logits_budget"),
    (dict(student_softcap=0.0), ValueError, "student_softcap"),
])
def test_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        fused_linear_jsd(**_bad(**over))


def test_auto_honours_the_backend_environment_variable(monkeypatch):
    from fused_ce_patch.backends import distill_chunked
    from fused_ce_patch.errors import BackendUnavailableError

    cpu = torch.device("cpu")
    monkeypatch.delenv("FUSED_CE_BACKEND", raising=False)
    assert distill_chunked.select_kernel(cpu, (torch.float32,)).name == "torch"
    monkeypatch.setenv("FUSED_CE_BACKEND", "reference")
    assert distill_chunked.select_kernel(cpu, (torch.float32,)).name == "torch"
    monkeypatch.setenv("FUSED_CE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError):
        fused_linear_jsd(**_bad())
    monkeypatch.setenv("FUSED_CE_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="FUSED_CE_BACKEND"):
        fused_linear_jsd(**_bad())
    monkeypatch.setenv("FUSED_CE_BACKEND", "torch")
    assert torch.isfinite(fused_linear_jsd(**_bad()))
    with pytest.raises(ValueError, match="unknown backend"):
        fused_linear_jsd(**_bad(backend="cuda"))


def test_num_items_requiring_grad_and_double_backward_are_clear_errors():
    # the fused losses take the count as a constant and have no second-order backward: both
    # are refused with a message that names the remedy, never a missing gradient
    from fused_ce_patch import fused_linear_cross_entropy, fused_linear_jsd

    g = torch.Generator().manual_seed(0)
    hs = torch.randn(6, 4, generator=g, requires_grad=True)
    ws = torch.randn(11, 4, generator=g)
    ht, wt = torch.randn(6, 5, generator=g), torch.randn(11, 5, generator=g)
    y = torch.randint(0, 11, (6,), generator=g)
    n = torch.tensor(4.0, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        fused_linear_jsd(hs, ws, ht, wt, y, num_items_in_batch=n)
    with pytest.raises(ValueError, match="requires grad"):
        fused_linear_cross_entropy(hs, ws, y, num_items_in_batch=n)
    got = fused_linear_jsd(hs, ws, ht, wt, y, num_items_in_batch=n.detach())
    assert torch.isfinite(got)
    with pytest.raises(RuntimeError, match="fused_linear_jsd does not support double backward"):
        torch.autograd.grad(got, hs, create_graph=True)

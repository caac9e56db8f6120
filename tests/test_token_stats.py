"""fused_linear_token_stats against a float64 materialised oracle: values and gradients."""

import math

import pytest
import torch

from fused_ce_patch import fused_linear_cross_entropy, fused_linear_token_stats


def _oracle(h, w, b, y, *, ignore_index=-100, softcap=None, scale=1.0, temperature=1.0):
    """Plain float64 formula, written independently of the package. Half-precision logits are
    rounded to the inputs' dtype first, as ``lm_head(hidden)`` rounds them."""
    x = (h @ w.t()).double() if h.dtype in (torch.float16, torch.bfloat16) else (
        h.double() @ w.double().t())
    if b is not None:
        x = x + b.double()
    x = x * scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    z = x / temperature
    logp = torch.log_softmax(z, -1)
    mask = y != ignore_index
    yy = y.clamp(min=0)
    lp = logp.gather(-1, yy.unsqueeze(-1)).squeeze(-1) * mask
    ent = -(logp.exp() * logp).sum(-1) * mask
    top1 = (z.argmax(-1) == yy) & mask
    return lp, ent, top1


def _inputs(n, h, v, *, bias=True, ignored=0.3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(n, h, generator=g) * 2).to(dtype).requires_grad_()
    w = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignored] = -100
    return hid, w, b, y


BACKENDS = ["torch", "reference", "auto"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", [
    {},
    {"softcap": 3.0},
    {"temperature": 0.7},
    {"logit_scale": 0.5, "softcap": 2.0, "temperature": 1.3},
])
def test_forward_backward_float64(backend, opts):
    hid, w, b, y = _inputs(37, 11, 53)
    # a small budget forces several row chunks
    out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True, accuracy=True,
                                   logits_budget=4 * 53 * 4 * 5, backend=backend,
                                   **opts)
    kw = {"softcap": opts.get("softcap"), "scale": opts.get("logit_scale", 1.0),
          "temperature": opts.get("temperature", 1.0)}
    ref = _oracle(hid, w, b, y, **kw)
    assert out.log_probs.dtype == torch.float64
    torch.testing.assert_close(out.log_probs, ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.entropy, ref[1], rtol=1e-10, atol=1e-10)
    assert torch.equal(out.is_top1, ref[2])
    assert torch.equal(out.mask, y != -100)
    # random per-token upstream gradients for both outputs
    g = torch.Generator().manual_seed(1)
    g_lp = torch.randn(37, generator=g, dtype=torch.float64)
    g_ent = torch.randn(37, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum(),
                              (hid, w, b))
    want = torch.autograd.grad((ref[0] * g_lp).sum() + (ref[1] * g_ent).sum(), (hid, w, b))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10)
    # ignored rows get no gradient
    assert torch.all(got[0][y == -100] == 0)


def test_matches_loss_reduction_none():
    hid, w, b, y = _inputs(29, 7, 41, seed=3)
    out = fused_linear_token_stats(hid, w, y, bias=b, softcap=5.0, backend="torch")
    loss = fused_linear_cross_entropy(hid, w, y, bias=b, softcap=5.0, reduction="none",
                                      backend="reference")
    torch.testing.assert_close(-out.log_probs, loss, rtol=1e-12, atol=1e-12)
    assert out.entropy is None and out.is_top1 is None


def test_gradcheck_float64():
    hid, w, b, y = _inputs(6, 4, 9, seed=5)

    def f(h_, w_, b_):
        o = fused_linear_token_stats(h_, w_, y, bias=b_, entropy=True, softcap=2.0,
                                     temperature=0.8, logits_budget=9 * 16 * 2,
                                     backend="torch")
        return o.log_probs, o.entropy

    assert torch.autograd.gradcheck(f, (hid, w, b))


def test_shift_and_batch_shape():
    hid, w, b, y = _inputs(24, 5, 17, seed=7)
    h3 = hid.detach().view(3, 8, 5)
    y3 = y.view(3, 8)
    out = fused_linear_token_stats(h3, w.detach(), y3, shift=True, accuracy=True)
    shifted = torch.cat([y3[:, 1:], torch.full((3, 1), -100)], 1)
    ref = _oracle(h3, w.detach(), None, shifted)
    assert out.log_probs.shape == (3, 8)
    torch.testing.assert_close(out.log_probs, ref[0], rtol=1e-10, atol=1e-10)
    assert torch.equal(out.is_top1, ref[2])
    assert not out.mask[:, -1].any()


def test_all_ignored_is_zero_and_backpropagates():
    hid, w, b, y = _inputs(5, 4, 7)
    y[:] = -100
    out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True)
    assert torch.all(out.log_probs == 0) and torch.all(out.entropy == 0)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert torch.all(hid.grad == 0) and torch.all(w.grad == 0)


def test_bfloat16_close_to_float32():
    hid, w, b, y = _inputs(33, 16, 70, dtype=torch.float32, seed=9)
    out = fused_linear_token_stats(hid.bfloat16(), w.bfloat16(), y, entropy=True,
                                   accuracy=True)
    ref = _oracle(hid.bfloat16(), w.bfloat16(), None, y)
    assert out.log_probs.dtype == torch.float32
    torch.testing.assert_close(out.log_probs.double(), ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.entropy.double(), ref[1], rtol=1e-4, atol=1e-4)
    out.log_probs.sum().backward()  # half-precision backward runs and keeps the dtypes


def test_autocast_casts_like_lm_head():
    hid, w, b, y = _inputs(9, 8, 21, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear_token_stats(hid, w, y)
    ref = _oracle(hid.bfloat16(), w.bfloat16(), None, y)
    torch.testing.assert_close(out.log_probs.double(), ref[0], rtol=1e-4, atol=1e-4)
    out.log_probs.sum().backward()
    assert w.grad.dtype == torch.float32


def test_is_top1_first_maximum_on_ties():
    w = torch.tensor([[1.0], [1.0], [0.0]], dtype=torch.float64)
    h = torch.ones(2, 1, dtype=torch.float64)
    out = fused_linear_token_stats(h, w, torch.tensor([0, 1]), accuracy=True)
    assert out.is_top1.tolist() == [True, False]
    torch.testing.assert_close(out.log_probs[0].item(), -math.log(2 + math.exp(-1)))


@pytest.mark.parametrize("kwargs,err", [
    ({"temperature": 0.0}, ValueError),
    ({"logit_scale": float("nan")}, ValueError),
    ({"softcap": -1.0}, ValueError),
    ({"backend": "nope"}, ValueError),
    ({"logits_budget": -1}, ValueError),
])
def test_bad_options(kwargs, err):
    hid, w, b, y = _inputs(3, 2, 5)
    with pytest.raises(err):
        fused_linear_token_stats(hid, w, y, **kwargs)


def test_bad_label_names_value_and_vocab():
    hid, w, b, y = _inputs(3, 2, 5)
    y[0] = 5
    with pytest.raises(ValueError, match="label 5.*V = 5"):
        fused_linear_token_stats(hid, w, y)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_mean_logits_and_log_sum_sq_probs(backend):
    hid, w, b, y = _inputs(23, 6, 31, seed=11)
    out = fused_linear_token_stats(hid, w, y, bias=b, softcap=4.0, temperature=0.9,
                                   mean_logits=True, log_sum_sq_probs=True,
                                   logits_budget=31 * 16 * 3, backend=backend)
    z = 4.0 * torch.tanh((hid.double() @ w.double().t() + b.double()) / 4.0) / 0.9
    mask = y != -100
    torch.testing.assert_close(out.mean_logits, z.mean(-1) * mask, rtol=1e-10, atol=1e-10)
    p = torch.softmax(z, -1)
    torch.testing.assert_close(out.log_sum_sq_probs, torch.log((p * p).sum(-1)) * mask,
                               rtol=1e-10, atol=1e-10)
    assert not out.mean_logits.requires_grad and not out.log_sum_sq_probs.requires_grad
    out.log_probs.sum().backward()  # the extra outputs do not disturb the backward


def test_row_and_vocab_tiles_both_split(monkeypatch):
    from fused_ce_patch.backends import token_stats as ts

    monkeypatch.setattr(ts, "ROWS_MAX", 4)  # several row tiles as well as vocabulary blocks
    hid, w, b, y = _inputs(19, 5, 29, seed=13)
    out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True, accuracy=True,
                                   softcap=3.0, logits_budget=16 * 4 * 6, backend="torch")
    assert ts.tile_shape(19, 29, 16 * 4 * 6) == (4, 6)
    ref = _oracle(hid, w, b, y, softcap=3.0)
    torch.testing.assert_close(out.log_probs, ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.entropy, ref[1], rtol=1e-10, atol=1e-10)
    assert torch.equal(out.is_top1, ref[2])
    g = torch.randn(19, dtype=torch.float64)
    got = torch.autograd.grad((out.log_probs * g).sum() + out.entropy.sum(), (hid, w, b))
    want = torch.autograd.grad((ref[0] * g).sum() + ref[1].sum(), (hid, w, b))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10)


def test_tiny_benchmark_runs(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_trl_head.py"
    spec = importlib.util.spec_from_file_location("gpu_trl_head", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    impls = "ours-sft,ours-logp,ours-grpo,ours-sft-tiles,ours-loss"
    if importlib.util.find_spec("trl") is not None and \
            importlib.util.find_spec("trl.kernels") is not None:  # trl >= 1.15
        impls += ",trl-sft,trl-logp,trl-grpo"
    rows = bench.main(["--tiny", "--iters", "1", "--warmup", "0", "--impls", impls,
                       "--out", str(tmp_path)])
    assert rows and all("error" not in r for r in rows), rows
    assert all(r["err_loss"] < 1e-3 and r["err_dh"] < 1e-2 for r in rows)
    assert (tmp_path / "gpu_trl_head_tiny.json").is_file()
    if "trl-sft" in impls and importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "gpu_trl_head_tiny.png").is_file()


@pytest.mark.parametrize("hint", [True, "on", 1])
def test_grad_hint_must_be_a_hint(hint):
    hid, w, b, y = _inputs(3, 2, 5)
    with pytest.raises(TypeError, match="grad_hint must be None or a ForwardGradHint"):
        fused_linear_token_stats(hid, w, y, grad_hint=hint)

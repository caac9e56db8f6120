"""Backend ``"triton"`` on a CUDA GPU at real sizes (marker ``gpu``; skipped without CUDA).

Run: ``pytest -m gpu tests/gpu -q``. References are computed on the GPU in float32 (TF32 off)
from the same low-precision inputs; low-precision results are held to "no worse than
PyTorch's own path" (a linear in the input dtype, then float32 cross-entropy) by
:data:`SLACK`, as in the CPU suite.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fused_ce_patch import fused_linear_cross_entropy
from fused_ce_patch.numerics import relative_error as rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLACK = 1.25
MiB = 2**20


@pytest.fixture(autouse=True)
def _fp32_matmul_exact():
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev


def inputs(n, h, v, dtype=torch.bfloat16, bias=False, ignore=0.1, logit_std=1.0):
    dev = "cuda"
    hidden = torch.randn(n, h, device=dev).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=dev) * (logit_std / math.sqrt(h))).to(dtype)
    weight.requires_grad_()
    labels = torch.randint(0, v, (n,), device=dev)
    labels[torch.rand(n, device=dev) < ignore] = -100
    b = (torch.randn(v, device=dev) * 0.5).to(dtype).requires_grad_() if bias else None
    return hidden, weight, labels, b


def reference(hidden, weight, labels, bias=None, reduction="mean", softcap=None,
              label_smoothing=0.0, z_loss=0.0, upcast=True):  # fmt: skip
    """The loss through materialised logits: float32 (``upcast``) or PyTorch's own path."""
    h, w = (hidden.float(), weight.float()) if upcast else (hidden, weight)
    b = None if bias is None else (bias.float() if upcast else bias)
    z = F.linear(h, w, b).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    per = F.cross_entropy(z, labels, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        per = per + z_loss * torch.logsumexp(z, -1).square() * (labels != -100)
    if reduction == "none":
        return per
    total = per.sum()
    return total / (labels != -100).sum().clamp(min=1) if reduction == "mean" else total


def compare(n, h, v, budget, dtype=torch.bfloat16, bias=False, reduction="mean", **opts):
    hidden, weight, labels, b = inputs(n, h, v, dtype, bias)
    leaves = [t for t in (hidden, weight, b) if t is not None]
    up = torch.rand(n, device="cuda") if reduction == "none" else torch.tensor(1.0, device="cuda")
    out = {}
    for who, fn in (
        ("ours", lambda: fused_linear_cross_entropy(
            hidden, weight, labels, bias=b, reduction=reduction, backend="triton",
            logits_budget=budget, **opts)),  # fmt: skip
        ("ref", lambda: reference(hidden, weight, labels, b, reduction, **opts)),
        ("torch", lambda: reference(hidden, weight, labels, b, reduction, upcast=False, **opts)),
    ):
        loss = fn()
        out[who] = (loss, *torch.autograd.grad(loss, leaves, up.to(loss.dtype)))
        del loss
    errs = []
    for i in range(len(leaves) + 1):
        ours, ref, theirs = (out[w][i] for w in ("ours", "ref", "torch"))
        assert torch.isfinite(ours).all()
        e, e_torch = rel(ours, ref), rel(theirs, ref)
        errs.append((e, e_torch))
        tol = 1e-5 if dtype == torch.float32 else SLACK * e_torch + 1e-6
        assert e <= tol, f"output {i}: error {e:.3g} vs torch's {e_torch:.3g}"
    return errs


@pytest.mark.parametrize("budget", [None, 0], ids=["chunked", "zero-logits"])
@pytest.mark.parametrize(
    "n,h,v,opts",
    [
        (4096, 4096, 128256, {}),
        (2048, 2304, 256000, {"softcap": 30.0}),
        (3001, 1003, 32003, {"label_smoothing": 0.1, "z_loss": 1e-4, "bias": True}),
        (2048, 640, 262144, {"reduction": "none"}),
    ],
    ids=["llama3", "gemma2-softcap", "odd-everything", "gemma3-none"],
)
def test_bf16_real_sizes(budget, n, h, v, opts):
    compare(n, h, v, budget, **opts)


@pytest.mark.parametrize("budget", [None, 0], ids=["chunked", "zero-logits"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_other_dtypes(budget, dtype):
    compare(1024, 1024, 50257, budget, dtype=dtype, reduction="sum", softcap=20.0)


@pytest.mark.parametrize("budget", [None, 0, 6 * 2**30], ids=["chunked", "zero-logits", "6GiB"])
def test_n_times_v_beyond_int32(budget):
    """N * V = 32768 * 128256 > 2**31 (and, at a 6 GiB budget, one chunk's logits too)."""
    n, h, v = 32768, 256, 128256
    assert n * v > 2**31
    compare(n, h, v, budget, softcap=30.0)


@pytest.mark.parametrize("budget", [None, 0], ids=["chunked", "zero-logits"])
def test_noncontiguous_hidden_and_tensor_num_items(budget):
    b, t, h, v = 4, 700, 896, 151936
    base = torch.randn(t + 37, b, h, device="cuda", dtype=torch.bfloat16)
    hidden = base.transpose(0, 1)[:, -t:, :].detach().requires_grad_()
    weight = (torch.randn(v, h, device="cuda") / math.sqrt(h)).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (b, t), device="cuda")
    labels[:, :50] = -100
    num = torch.tensor(5000, device="cuda")
    ours = fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=num,
                                      shift=True, backend="triton", logits_budget=budget)
    shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), -100)], 1)
    ref = reference(hidden.reshape(-1, h), weight, shifted.reshape(-1), reduction="sum") / 5000
    theirs = reference(hidden.reshape(-1, h), weight, shifted.reshape(-1), reduction="sum",
                       upcast=False) / 5000  # fmt: skip
    for a, r, t_ in zip(
        (ours, *torch.autograd.grad(ours, [hidden, weight])),
        (ref, *torch.autograd.grad(ref, [hidden, weight])),
        (theirs, *torch.autograd.grad(theirs, [hidden, weight])),
    ):
        assert rel(a, r) <= SLACK * rel(t_, r) + 1e-6


@pytest.mark.parametrize("budget,limit", [(None, 256 * MiB), (0, 8 * MiB)],
                         ids=["chunked", "zero-logits"])  # fmt: skip
@pytest.mark.parametrize("h,v", [(4096, 128256), (4096, 32000), (2304, 256000)],
                         ids=["llama3", "llama2", "gemma2"])  # fmt: skip
def test_peak_memory_beyond_grads(budget, limit, h, v):
    """Peak allocated during fwd+bwd beyond the inputs and the bf16 dH, dW themselves."""
    n = 8192
    hidden, weight, labels, _ = inputs(n, h, v)
    fused_linear_cross_entropy(hidden, weight, labels, backend="triton",
                               logits_budget=budget).backward()  # fmt: skip  (warm-up)
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_linear_cross_entropy(hidden, weight, labels, backend="triton",
                               logits_budget=budget).backward()  # fmt: skip
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - (n + v) * h * 2
    print(f"extra = {extra / MiB:.1f} MiB")
    assert extra <= limit


def test_auto_picks_triton_for_cuda(monkeypatch):
    from fused_ce_patch.backends import triton as triton_backend
    from fused_ce_patch.backends.triton import chunked_path

    calls = []
    original = chunked_path.TritonChunkedLinearCrossEntropy.apply
    monkeypatch.setattr(chunked_path.TritonChunkedLinearCrossEntropy, "apply",
                        lambda *a: calls.append(1) or original(*a))  # fmt: skip
    hidden, weight, labels, _ = inputs(64, 64, 1000)
    fused_linear_cross_entropy(hidden, weight, labels)
    assert calls and triton_backend.TritonBackend.name == "triton"


# -- issue 9: loss scaling, softcap range, no global flags ---------------------------------


@pytest.mark.parametrize("budget", [None, 0], ids=["chunked", "zero-logits"])
@pytest.mark.parametrize("scale", [1.0, 2.0**16, 2.0**24, 2.0**-6])
def test_fp16_loss_scaling(budget, scale):
    """fp16, ``(loss * scale).backward()``, gradients / scale: no worse than PyTorch's path at
    every scale (the forward-time gradient rounded at 1/N was 2e-2 off at 2**16)."""
    n, h, v = 8192, 256, 32000
    hidden = torch.randn(n, h, device="cuda").half().requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * 0.02).half().requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[torch.rand(n, device="cuda") < 0.1] = -100
    grads = {}
    for who, fn in (
        ("ours", lambda: fused_linear_cross_entropy(hidden, weight, labels, backend="triton",
                                                    logits_budget=budget)),  # fmt: skip
        ("torch", lambda: reference(hidden, weight, labels, upcast=False)),
    ):
        grads[who] = torch.autograd.grad(fn() * scale, [hidden, weight])
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ref = torch.autograd.grad(F.cross_entropy(h64 @ w64.t(), labels), [h64, w64])
    for name, ours, theirs, r in zip(("dH", "dW"), grads["ours"], grads["torch"], ref):
        if not torch.isfinite(theirs).all():
            continue  # PyTorch overflows too (GradScaler skips the step)
        assert torch.isfinite(ours).all(), name
        e, e_torch = rel(ours.double() / scale, r), rel(theirs.double() / scale, r)
        assert e <= SLACK * e_torch + 1e-5, f"{name}: {e:.3g} vs torch's {e_torch:.3g}"


@pytest.mark.parametrize("budget", [None, 0], ids=["chunked", "zero-logits"])
@pytest.mark.parametrize("softcap", [1e-2, 1.0, 30.0, 1e4, 1e8])
def test_softcap_range_fp32(budget, softcap):
    """``c * tanh(z / c)`` accurate whatever the cap (1e-2: saturated; 1e8: |z| << c)."""
    n, h, v = 1024, 256, 32003
    hidden, weight, labels, _ = inputs(n, h, v, torch.float32)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    z = h64 @ w64.t()
    ref_loss = F.cross_entropy(softcap * torch.tanh(z / softcap), labels)
    ref = torch.autograd.grad(ref_loss, [h64, w64])
    loss = fused_linear_cross_entropy(hidden, weight, labels, softcap=softcap, backend="triton",
                                      logits_budget=budget)  # fmt: skip
    # PyTorch's float32 path as the floor: at c = 0.01 a slope 4 exp(-2|z|/c) multiplies the
    # float32 rounding of z by 2/c in any float32 implementation
    stock = reference(hidden, weight, labels, softcap=softcap)
    assert rel(loss, ref_loss) <= 3e-5
    grads = zip(("dH", "dW"), torch.autograd.grad(loss, [hidden, weight]), ref,
                torch.autograd.grad(stock, [hidden, weight]))
    for name, g, r, s in grads:
        tol = max(3e-5, SLACK * rel(s, r))
        assert rel(g, r) <= tol, f"{name}: {rel(g, r):.3g} > {tol:.3g} at softcap {softcap:g}"


def test_global_matmul_flags_untouched():
    """Precision is asked of the matmuls; torch's process-wide flags are never written."""
    mm = torch.backends.cuda.matmul
    names = ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
    before = tuple(getattr(mm, f) for f in names)
    try:
        for value in (True, False):
            for f in names:
                setattr(mm, f, value)
            hidden, weight, labels, _ = inputs(512, 256, 4099, torch.float16)
            fused_linear_cross_entropy(hidden, weight, labels, backend="triton").backward()
            assert tuple(getattr(mm, f) for f in names) == (value, value)
    finally:
        for f, v in zip(names, before):
            setattr(mm, f, v)


@pytest.mark.parametrize(
    "n,h,v,opts",
    [
        (4096, 4096, 128256, {}),
        (2048, 2304, 256000, {"softcap": 30.0, "bias": True}),
        (3001, 1003, 32003, {"label_smoothing": 0.1, "z_loss": 1e-4, "reduction": "none"}),
    ],
    ids=["llama3", "gemma2-softcap-bias", "odd-everything-none"],
)
def test_zero_logits_bitwise_repeatable(monkeypatch, n, h, v, opts):
    """``logits_budget=0`` runs its in-place backward here (spied) and gives the same bits in
    two runs: no float32 atomics, one writer per output element."""
    from fused_ce_patch.backends.triton import zero_logits_inplace

    calls = []
    original = zero_logits_inplace.backward
    monkeypatch.setattr(zero_logits_inplace, "backward",
                        lambda *a, **k: calls.append(1) or original(*a, **k))  # fmt: skip
    opts = dict(opts)
    hidden, weight, labels, b = inputs(n, h, v, bias=opts.pop("bias", False))
    leaves = [t for t in (hidden, weight, b) if t is not None]
    runs = []
    for _ in range(2):
        loss = fused_linear_cross_entropy(hidden, weight, labels, bias=b, backend="triton",
                                          logits_budget=0, **opts)  # fmt: skip
        up = torch.ones_like(loss) if loss.dim() else None
        runs.append((loss, *torch.autograd.grad(loss, leaves, up)))
    assert len(calls) == 2
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@pytest.mark.parametrize(
    "n,h,v,dtype,opts",
    [
        (2048, 4096, 128256, torch.bfloat16, {}),
        (2048, 2304, 256000, torch.bfloat16, {"softcap": 30.0, "bias": True}),
        (8192, 640, 262144, torch.bfloat16, {"label_smoothing": 0.1}),
        (1500, 1024, 50257, torch.float16, {"z_loss": 1e-4, "bias": True}),
        (2048, 2304, 256000, torch.bfloat16, {"softcap": 30.0, "bias": True, "runs": True}),
        (1500, 1024, 50257, torch.float16, {"label_smoothing": 0.1, "runs": True}),
        (16384, 640, 262144, torch.bfloat16, {}),
    ],
    ids=["llama3", "gemma2-softcap-bias", "gemma3-smoothing", "fp16-odd-vocab",
         "gemma2-softcap-bias-runs", "fp16-odd-vocab-runs", "gemma3-n-per-h-26"],
)
def test_zero_logits_forwards_agree(monkeypatch, n, h, v, dtype, opts):
    """The TMA forward (the default on this GPU where it applies; spied), the cuBLAS matmul
    forward and the Triton forward give one loss to float32 summation order, the gradients
    follow, and the loss is float32's (materialised logits). ``runs``: the TMA forward's
    per-run kernel forced; at N/H = 26 it is the rule's choice (and the matmul forward steps
    aside to the Triton forward)."""
    from fused_ce_patch.backends.triton import launch, zero_logits

    if not launch.tma_device(torch.device("cuda")):
        pytest.skip("no TMA on this GPU")
    calls = []
    original = launch.CudaLaunchers.lse_tma
    monkeypatch.setattr(launch.CudaLaunchers, "lse_tma",
                        lambda *a, **k: calls.append(1) or original(*a, **k))  # fmt: skip
    launched = []
    kernel = launch.lse_tma_runs_kernel

    class RunsSpy:
        def __getitem__(self, grid):
            return lambda *a, **k: launched.append(1) or kernel[grid](*a, **k)

    monkeypatch.setattr(launch, "lse_tma_runs_kernel", RunsSpy())
    opts = dict(opts)
    if opts.pop("runs", False):
        monkeypatch.setattr(launch, "TMA_RUNS_MIN_ROWS_PER_HIDDEN", 0)
    want_runs = n > launch.TMA_RUNS_MIN_ROWS_PER_HIDDEN * h
    hidden, weight, labels, b = inputs(n, h, v, dtype, bias=opts.pop("bias", False))
    leaves = [t for t in (hidden, weight, b) if t is not None]
    runs = {}
    for name, tma, mm in (("tma", True, True), ("matmul", False, True), ("triton", False, False)):
        monkeypatch.setattr(zero_logits, "TMA_FORWARD", tma)
        monkeypatch.setattr(zero_logits, "MATMUL_FORWARD", mm)
        loss = fused_linear_cross_entropy(hidden, weight, labels, bias=b, backend="triton",
                                          logits_budget=0, **opts)  # fmt: skip
        runs[name] = (loss, *torch.autograd.grad(loss, leaves))
    assert len(calls) == 1 and len(launched) == int(want_runs)
    for other in ("matmul", "triton"):
        assert rel(runs["tma"][0], runs[other][0]) <= 2e-6, other
        for a, c in zip(runs["tma"][1:], runs[other][1:]):
            assert rel(a, c) <= 1e-3, other
    assert rel(runs["tma"][0], reference(hidden, weight, labels, bias=b, **opts)) <= 1e-5


@pytest.mark.parametrize(
    "n, h, v, dtype, opts",
    [
        (2048, 2304, 256000, torch.bfloat16, {"softcap": 30.0, "bias": True}),
        (4096, 128, 65536, torch.bfloat16, {"label_smoothing": 0.1, "z_loss": 1e-4}),
        (1500, 1024, 50257, torch.float16, {"reduction": "sum"}),
    ],
    ids=["gemma2-softcap-bias", "n-per-h-32-smoothing-zloss", "fp16-odd-vocab"],
)
def test_zero_logits_gradient_kernels_agree(monkeypatch, n, h, v, dtype, opts):
    """The in-place backward's chunk gradients from the TMA GEMM with the gradient in its
    epilogue (the default on this GPU; spied) and from float32 cuBLAS logits with
    ``logits_grad_cols`` give the same gradients to float32 summation order; at N/H = 32 (above
    ``MAX_ROWS_PER_HIDDEN``) the float32-logit run is the tiled kernels', and both runs are
    held to float32's gradients (no worse than ``SLACK`` x PyTorch's own path)."""
    from fused_ce_patch.backends.triton import launch, zero_logits_inplace

    if not launch.tma_device(torch.device("cuda")):
        pytest.skip("no TMA on this GPU")
    calls = []
    original = launch.CudaLaunchers.grad_tma
    monkeypatch.setattr(launch.CudaLaunchers, "grad_tma",
                        lambda *a, **k: calls.append(1) or original(*a, **k))  # fmt: skip
    opts = dict(opts)
    hidden, weight, labels, b = inputs(n, h, v, dtype, bias=opts.pop("bias", False))
    leaves = [t for t in (hidden, weight, b) if t is not None]
    runs = {}
    for tma in (True, False):
        monkeypatch.setattr(zero_logits_inplace, "TMA_GRAD", tma)
        calls.clear()
        loss = fused_linear_cross_entropy(hidden, weight, labels, bias=b, backend="triton",
                                          logits_budget=0, **opts)  # fmt: skip
        runs[tma] = (loss, *torch.autograd.grad(loss, leaves))
        assert (len(calls) > 0) == tma
    assert torch.equal(runs[True][0], runs[False][0])  # the same forward
    if n <= zero_logits_inplace.MAX_ROWS_PER_HIDDEN * h:  # the same products both times
        for a, c in zip(runs[True][1:], runs[False][1:]):
            assert rel(a, c) <= 1e-3
        return
    # against the tiled kernels, which round dW once from float32 where the in-place backward
    # rounds its target rows once more (their float32 column added after the product): the
    # two are ~7.5e-4 apart in dW (interpreter, N/H = 32), so each is held to float32 as the
    # suite holds low-precision results: no worse than SLACK x PyTorch's own path's error
    ref = reference(hidden, weight, labels, bias=b, **opts)
    theirs = reference(hidden, weight, labels, bias=b, upcast=False, **opts)
    want = torch.autograd.grad(ref, leaves)
    torch_err = [rel(t_, r) for t_, r in zip(torch.autograd.grad(theirs, leaves), want)]
    for run in runs.values():
        for got, r, e_torch in zip(run[1:], want, torch_err):
            assert rel(got, r) <= SLACK * e_torch + 1e-6

"""The zero-logits path's in-place backward (``backends/triton/zero_logits_inplace.py``) under
the Triton interpreter: against float64 at non-divisible sizes with every option, the chunk
layout's edge cases (logits of a tail chunk in dW's free rows, in the tail buffer), bitwise
repeatability, and when it steps aside for the tiled kernels.

Low-precision results are held to "no worse than PyTorch's own path" (:data:`SLACK`), as in
the shared suite; the tiled kernels' error on the same inputs is printed beside ours.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA",
                allow_module_level=True)  # fmt: skip
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from interpreted import import_kernels  # noqa: E402

import_kernels()  # before anything else imports the kernels
from fused_ce_patch.backends.triton import zero_logits_inplace as zi  # noqa: E402
from fused_ce_patch.backends.triton.launch import CUDA_LAUNCHERS  # noqa: E402
from semantics import Case, make  # noqa: E402

pytestmark = pytest.mark.usefixtures("seed", "one_thread")

#: Our error may exceed PyTorch's own path's (linear in the input dtype, float32 CE) by this.
SLACK = 1.25
CASE = Case("triton", logits_budget=0)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, params=[True, False], ids=["tma-grad", "cols-grad"])
def grad_kernel(request, monkeypatch):
    """Each test twice: chunk gradients from the TMA GEMM with the gradient in its epilogue
    (16-bit gradient only, where the operands suit TMA: rows of a multiple of 16 bytes), and
    from float32 logits and ``logits_grad_cols`` (``zi.TMA_GRAD`` off)."""
    monkeypatch.setattr(zi, "TMA_GRAD", request.param)
    return request.param


@pytest.fixture
def spy(monkeypatch):
    """Counts the in-place backward's runs (``spy.plans``: their plans)."""
    calls = SpyList()
    original = zi.backward

    def wrapped(p, *args, **kw):
        calls.append(1)
        calls.plans.append(p)
        return original(p, *args, **kw)

    monkeypatch.setattr(zi, "backward", wrapped)
    return calls


@pytest.fixture
def tma_spy(monkeypatch):
    """Records each ``launchers.grad_tma`` call (its chunk's column count)."""
    calls = []
    launchers = type(CUDA_LAUNCHERS)
    original = launchers.grad_tma

    def wrapped(self, h2, weight, g, *args, **kw):
        calls.append(g.shape[1])
        return original(self, h2, weight, g, *args, **kw)

    monkeypatch.setattr(launchers, "grad_tma", wrapped)
    return calls


class SpyList(list):
    def __init__(self):
        super().__init__()
        self.plans = []


def _stock(hidden, weight, labels, bias=None, reduction="mean", num_items_in_batch=None,
           softcap=None, label_smoothing=0.0, z_loss=0.0):  # fmt: skip
    """PyTorch's own path: the linear in the input dtype, the loss in float32."""
    z = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z, y = z.reshape(-1, weight.shape[0]), labels.reshape(-1)
    per = F.cross_entropy(z, y, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        per = per + z_loss * torch.logsumexp(z, -1).square() * (y != -100)
    if reduction == "none":
        return per.view(labels.shape)
    total = per.sum()
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    return total / (y != -100).sum().clamp(min=1) if reduction == "mean" else total


def _run(oracle, hidden, weight, labels, bias, **opts):
    """``{who: (loss, *grads)}`` for ours, the float64 oracle and PyTorch's path."""
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    exact = [t.detach().double().requires_grad_() for t in leaves]
    ex_b = exact[2] if bias is not None else None
    out = {}
    for who, fn, wrt in (
        ("ours", lambda: CASE.loss(hidden, weight, labels, bias=bias, **opts), leaves),
        ("ref", lambda: oracle.loss(exact[0], exact[1], labels, bias=ex_b, **opts), exact),
        ("torch", lambda: _stock(hidden, weight, labels, bias, **opts), leaves),
    ):
        loss = fn()
        up = torch.linspace(-0.5, 1.5, loss.numel(), dtype=torch.float64).view(loss.shape)
        out[who] = (loss, *torch.autograd.grad(loss, wrt, up.to(loss.dtype)))
    return out


def _check(oracle, out):
    for i, (ours, ref, theirs) in enumerate(zip(out["ours"], out["ref"], out["torch"])):
        assert torch.isfinite(ours).all()
        e, e_torch = oracle.rel_err(ours, ref), oracle.rel_err(theirs, ref)
        assert e <= SLACK * e_torch + 1e-6, (i, e, e_torch)


def _force_compact(monkeypatch, compact: bool) -> None:
    """The counted-rows pass wherever it fits (``compact``), or never: these small cases test
    its arithmetic, not the speed policy (:func:`zi._compact_pays`)."""
    monkeypatch.setattr(zi, "COMPACT", compact)
    monkeypatch.setattr(zi, "COMPACT_MIN_SAVING", 0.0)
    monkeypatch.setattr(zi, "COMPACT_MAX_UNDER", 1.0)


OPTIONS = [
    {},
    {"softcap": 4.0},
    {"label_smoothing": 0.1, "z_loss": 1e-3, "bias": True},
    {"reduction": "none", "bias": True},
    {"reduction": "sum", "softcap": 30.0, "z_loss": 1e-4},
    {"num_items_in_batch": 23},
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(map(str, o)) or "plain")
# all-rows: the same kernels over every row, each case ~4x the time in the interpreter: slow.
@pytest.mark.parametrize("compact", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["counted-rows", "all-rows"])
def test_against_float64(oracle, spy, tma_spy, monkeypatch, grad_kernel, dtype, opts, compact):
    """N = 39 rows (a quarter ignored), prime V = 211; the first pass over the counted rows
    (gathered) or over all rows. Float32 logits: odd H = 23 (chunks of 11 columns); the TMA
    gradient: H = 24 (rows of 48 bytes, chunks of 24 columns, 16-bit gradient only)."""
    _force_compact(monkeypatch, compact)
    opts = dict(opts)
    bias = opts.pop("bias", False)
    hidden, weight, labels, b = make(CASE, (3, 13), 24 if grad_kernel else 23, 211,
                                     dtype=dtype, bias=bias, logit_std=3.0)  # fmt: skip
    _check(oracle, _run(oracle, hidden, weight, labels, b, **opts))
    assert spy == [1] and spy.plans[0].compact == compact
    assert (len(tma_spy) > 0) == grad_kernel


def test_tma_gradient_rows_per_hidden(oracle, spy, tma_spy, grad_kernel):
    """N / H = 20 (160 rows, H = 8): above ``MAX_ROWS_PER_HIDDEN`` (the tiled kernels run with
    float32 logits) and within ``MAX_ROWS_PER_HIDDEN_TMA`` (the in-place backward runs with the
    TMA gradient); exact either way."""
    assert zi.MAX_ROWS_PER_HIDDEN < 20 <= zi.MAX_ROWS_PER_HIDDEN_TMA
    hidden, weight, labels, b = make(CASE, (4, 40), 8, 401, dtype=torch.bfloat16,
                                     logit_std=2.0)  # fmt: skip
    _check(oracle, _run(oracle, hidden, weight, labels, b, softcap=10.0))
    assert spy == ([1] if grad_kernel else [])
    assert (len(tma_spy) > 0) == grad_kernel


def test_tma_gradient_needs_aligned_rows(spy, tma_spy, grad_kernel):
    """Rows of 40 bytes (H = 20) do not suit TMA: float32 logits and ``logits_grad_cols``
    even with ``TMA_GRAD`` on."""
    hidden, weight, labels, _ = make(CASE, (30,), 20, 97, dtype=torch.bfloat16)
    loss = CASE.loss(hidden, weight, labels)
    torch.autograd.grad(loss, (hidden, weight))
    assert spy == [1] and tma_spy == []


# One column a chunk: over a minute per kernel in the interpreter, slow.
@pytest.mark.parametrize("cols", [pytest.param(1, marks=pytest.mark.slow), 4, 7])
def test_narrow_chunks(oracle, spy, monkeypatch, cols):
    """Chunks narrower than dH's storage holds (``MAX_CHUNK_COLS``; 11 columns at H = 23):
    the vocabulary split in 1, 4 or 7 columns, V = 211 not a multiple of any; the chunks under
    dH's accumulator capped alike (a 2-column tail buffer, so the cap is what limits them)."""
    monkeypatch.setattr(zi, "MAX_CHUNK_COLS", cols)
    monkeypatch.setattr(zi, "TAIL_SCRATCH_BYTES", 4 * 39 * 2)
    monkeypatch.setattr(zi, "MIN_TAIL_COLS", 1)
    hidden, weight, labels, b = make(CASE, (3, 13), 23, 211, dtype=torch.bfloat16, bias=True,
                                     logit_std=3.0)  # fmt: skip
    _check(oracle, _run(oracle, hidden, weight, labels, b, softcap=20.0, z_loss=1e-4))
    assert spy == [1]


@pytest.mark.parametrize("tail_bytes", [4 * 39 * 1, 4 * 39 * 5], ids=["own-rows", "tail-buffer"])
def test_tail_chunks(oracle, spy, monkeypatch, tail_bytes):
    """dW of the rows under the float32 accumulator: chunks whose logits fit in the free rows
    below them (narrowing down to one column: a one-column tail buffer), or the tail buffer for
    all but the first (five columns a chunk); V just above 2N so that most of the vocabulary
    is in the tail."""
    monkeypatch.setattr(zi, "COMPACT", False)  # the all-rows pass's accumulator: 2N rows
    monkeypatch.setattr(zi, "TAIL_SCRATCH_BYTES", tail_bytes)
    monkeypatch.setattr(zi, "MIN_TAIL_COLS", 1)
    hidden, weight, labels, b = make(CASE, (39,), 24, 83, dtype=torch.bfloat16, bias=True,
                                     logit_std=2.0)  # fmt: skip
    p = zi.plan(hidden, weight, CUDA_LAUNCHERS, True, True, 30)
    assert p is not None and p.v_acc < 83 - 2 * 39 + 1
    _check(oracle, _run(oracle, hidden, weight, labels, b, reduction="sum"))
    assert spy == [1]


def test_matches_the_tiled_kernels(oracle, spy, monkeypatch):
    """Both backwards are exact (float32 sums of the same products): their errors against
    float64 agree to within a few percent for the loss, dH and the rows of dW that are no
    row's target. The in-place backward rounds a target row of dW twice (docs/limits.md), so
    those rows may be off by one more rounding (2^-8 relative) than the tiled kernels' — at
    this size a fifth of dW's rows are targets, enough to move the whole of dW by over 10 %
    at some seeds (1184161957). db, which the in-place backward sums from the 16-bit gradient
    as PyTorch's own path does (the tiled kernels sum float32 values), is held to PyTorch's
    error instead."""
    hidden, weight, labels, b = make(CASE, (2, 17), 31, 157, dtype=torch.bfloat16, bias=True,
                                     logit_std=3.0)  # fmt: skip
    flat = labels.reshape(-1)
    target = torch.zeros(157, dtype=torch.bool)
    target[flat[flat != -100]] = True
    errs = {}
    for enabled in (True, False):
        monkeypatch.setattr(zi, "ENABLED", enabled)
        out = _run(oracle, hidden, weight, labels, b, label_smoothing=0.05)
        (loss, dh, dw), (r_loss, r_dh, r_dw) = out["ours"][:3], out["ref"][:3]
        errs[enabled] = [oracle.rel_err(loss, r_loss), oracle.rel_err(dh, r_dh),
                         oracle.rel_err(dw[~target], r_dw[~target]),
                         oracle.rel_err(dw[target], r_dw[target])]
        if enabled:
            _check(oracle, out)
    assert spy == [1]
    for new, old in zip(errs[True][:3], errs[False][:3]):
        assert new <= 1.1 * old + 1e-6, (errs[True], errs[False])
    assert errs[True][3] <= errs[False][3] + 2.0**-8, (errs[True], errs[False])


def test_bitwise_repeatable(spy):
    """Two runs give the same bits (no atomics; every output element has one writer)."""
    hidden, weight, labels, b = make(CASE, (3, 11), 19, 131, dtype=torch.bfloat16, bias=True)
    runs = []
    for _ in range(2):
        loss = CASE.loss(hidden, weight, labels, bias=b, softcap=10.0, label_smoothing=0.1)
        runs.append((loss, *torch.autograd.grad(loss, [hidden, weight, b])))
    assert spy == [1, 1]
    for a, c in zip(*runs):
        assert torch.equal(a, c)


def test_ignored_rows_get_zero_and_all_ignored(spy):
    hidden, weight, labels, _ = make(CASE, (20,), 16, 67, dtype=torch.bfloat16, ignore_frac=0)
    labels[5:12] = -100
    loss = CASE.loss(hidden, weight, labels, reduction="sum")
    dh, dw = torch.autograd.grad(loss, [hidden, weight])
    assert (dh[5:12] == 0).all() and (dh[:5] != 0).any() and spy == [1]
    labels[:] = -100  # no counted row: zero loss and gradients, the tiled driver's business
    loss = CASE.loss(hidden, weight, labels)
    dh, dw = torch.autograd.grad(loss, [hidden, weight])
    assert loss.item() == 0.0 and not dh.any() and not dw.any() and spy == [1]


def test_steps_aside(grad_kernel):
    """Cases the plan leaves to the tiled kernels."""
    h16 = torch.randn(40, 8, dtype=torch.bfloat16)
    w16 = torch.randn(97, 8, dtype=torch.bfloat16)
    assert zi.plan(h16, w16, CUDA_LAUNCHERS, True, True, 30) is not None
    assert zi.plan(h16, w16, CUDA_LAUNCHERS, True, False, 30) is None  # frozen lm_head
    assert zi.plan(h16, w16, CUDA_LAUNCHERS, False, True, 30) is None  # no dH wanted
    assert zi.plan(h16, w16, CUDA_LAUNCHERS, True, True, 0) is None  # nothing counted
    assert zi.plan(h16.float(), w16.float(), CUDA_LAUNCHERS, True, True, 30) is None
    assert zi.plan(h16, w16.half(), CUDA_LAUNCHERS, True, True, 30) is None
    assert zi.plan(h16, w16[:79], CUDA_LAUNCHERS, True, True, 30) is None  # V < 2N
    assert zi.plan(h16, w16, object(), True, True, 30) is None  # launchers without the kernel
    strided = torch.randn(8, 5, 16, dtype=torch.bfloat16)[:, :, ::2].transpose(0, 1)
    assert zi.plan(strided, w16, CUDA_LAUNCHERS, True, True, 30) is None  # no [N, H] view
    every_other = torch.randn(40, 16, dtype=torch.bfloat16)[:, ::2]  # columns not unit-stride
    assert zi.plan(every_other, w16, CUDA_LAUNCHERS, True, True, 30) is None
    assert zi.plan(h16, w16.t().contiguous().t(), CUDA_LAUNCHERS, True, True, 30) is None
    # N > MAX_ROWS_PER_HIDDEN(_TMA) * H; rows of 16 bytes suit the TMA gradient
    most = zi.MAX_ROWS_PER_HIDDEN_TMA if grad_kernel else zi.MAX_ROWS_PER_HIDDEN
    for rows, steps_aside in ((most * 8, False), ((most + 1) * 8, True)):
        h = torch.randn(rows, 8, dtype=torch.bfloat16)
        w = torch.randn(2 * rows + 3, 8, dtype=torch.bfloat16)
        assert (zi.plan(h, w, CUDA_LAUNCHERS, True, True, rows) is None) == steps_aside, rows


def test_no_tail_room_steps_aside_even_with_min_tail_cols_zero(monkeypatch, grad_kernel):
    """A scratch buffer too small for one column of N rows (float32 logits, or the TMA
    gradient's 16-bit values) gives tail chunks of no columns: the plan must step aside (a
    loop over chunks of width 0 would never end)."""
    h16 = torch.randn(40, 8, dtype=torch.bfloat16)
    w16 = torch.randn(97, 8, dtype=torch.bfloat16)
    per_logit = 2 if grad_kernel else 4  # rows of 16 bytes suit the TMA gradient
    monkeypatch.setattr(zi, "TAIL_SCRATCH_BYTES", per_logit * 40 - 4)  # under one column
    for min_cols in (16, 1, 0):
        monkeypatch.setattr(zi, "MIN_TAIL_COLS", min_cols)
        assert zi.plan(h16, w16, CUDA_LAUNCHERS, True, True, 30) is None
        assert zi.plan(h16, w16, CUDA_LAUNCHERS, True, True, 10) is None  # counted-rows pass


def test_tail_room_counts_the_gradients_slots(monkeypatch, grad_kernel):
    """A scratch buffer of 1300 bytes holds 8 float32 columns of 40 rows (under
    ``MIN_TAIL_COLS`` = 16: the plan steps aside) but 16 columns of the TMA gradient's 16-bit
    values (the plan runs): the plan sizes its tail chunks by what the passes store."""
    monkeypatch.setattr(zi, "TAIL_SCRATCH_BYTES", 1300)
    monkeypatch.setattr(zi, "MIN_TAIL_COLS", 16)
    h16 = torch.randn(40, 8, dtype=torch.bfloat16)  # rows of 16 bytes
    w16 = torch.randn(97, 8, dtype=torch.bfloat16)
    p = zi.plan(h16, w16, CUDA_LAUNCHERS, True, True, 40)
    assert (p is not None) == grad_kernel
    if grad_kernel:
        assert p.tail_cols == 16


def test_padded_rows_keep_the_float32_rule(grad_kernel):
    """H = 20 in rows padded to 24 (48 bytes: hidden itself suits TMA, its gathered rows of
    40 bytes do not): the counted-rows pass would form float32 logits, so the float32 rule
    ``N <= MAX_ROWS_PER_HIDDEN * H`` holds there with the TMA gradient on too."""
    rows = (zi.MAX_ROWS_PER_HIDDEN + 1) * 20
    h = torch.randn(rows, 24, dtype=torch.bfloat16)[:, :20]
    w = torch.randn(2 * rows + 3, 24, dtype=torch.bfloat16)[:, :20]
    assert zi._tma_grad(h, w, CUDA_LAUNCHERS) == grad_kernel
    assert zi.plan(h, w, CUDA_LAUNCHERS, True, True, rows - 7) is None


def test_chunk_width_follows_the_l2_cache(monkeypatch):
    """Chunks of float32 logits about L2-sized (nearest 128 columns, at least 128; 16-bit
    gradients at least 2048), no cap where no L2 size is known; ``MAX_CHUNK_COLS``
    overrides."""
    monkeypatch.setattr(zi, "_l2_bytes", lambda device: 60 * 2**20)
    cuda = torch.device("cuda")
    assert zi.chunk_cols(8192, cuda) == 1920  # 60 MiB / 32 KiB per column
    assert zi.chunk_cols(32768, cuda) == 512  # 480 -> nearest multiple of 128
    assert zi.chunk_cols(2**22, cuda) == zi.MIN_L2_CHUNK_COLS
    # 16-bit gradients (the TMA kernel): twice the columns, at least MIN_L2_CHUNK_COLS_16BIT;
    # H / slots caps chunks in dH's storage, and float32 chunks anywhere, but not 16-bit
    # chunks in dW's free rows
    assert zi.chunk_cols(8192, cuda, 2) == 3840  # 60 MiB / 16 KiB per column
    assert zi.chunk_cols(32768, cuda, 2) == 2048  # 960 -> 1024, below the floor
    monkeypatch.setattr(zi, "MIN_L2_CHUNK_COLS_16BIT", 128)
    assert zi.chunk_cols(32768, cuda, 2) == 1024  # 960 -> nearest multiple of 128
    assert zi._chunk_width(32768, 640, cuda, slots=1) == 640
    assert zi._chunk_width(32768, 640, cuda, slots=1, in_dh=False) == 1024
    assert zi._chunk_width(32768, 640, cuda, slots=2, in_dh=False) == 320
    monkeypatch.setattr(zi, "MIN_L2_CHUNK_COLS_16BIT", 2048)
    assert zi._chunk_width(32768, 640, cuda, slots=1, in_dh=False) == 2048
    assert zi._chunk_width(32768, 4096, cuda, slots=1) == 2048
    assert zi._chunk_width(32768, 4096, cuda, slots=2) == 512
    assert zi._chunk_width(8192, 4096, cuda, slots=2) == 1920
    monkeypatch.setattr(zi, "MAX_CHUNK_COLS", 96)
    assert zi.chunk_cols(8192, cuda) == 96
    monkeypatch.setattr(zi, "MAX_CHUNK_COLS", None)
    monkeypatch.setattr(zi, "_l2_bytes", lambda device: 0)
    assert zi.chunk_cols(8192, torch.device("cpu")) >= 2**31


@pytest.mark.parametrize("tail_cols", [1, 5], ids=["free-rows", "scratch"])
def test_counted_rows_pass(oracle, spy, monkeypatch, tail_cols):
    """The first pass over the gathered counted rows (30 of 39): V = 83 just large enough for
    it (the columns under its accumulator take their logits from dW's first rows), the last
    chunks at dW's start narrowing in the free rows down to one column, or moving to a scratch
    buffer of five (of 39 rows; six of 30); a label in every region of the vocabulary."""
    _force_compact(monkeypatch, True)
    monkeypatch.setattr(zi, "TAIL_SCRATCH_BYTES", 4 * 39 * tail_cols)
    monkeypatch.setattr(zi, "MIN_TAIL_COLS", 1)
    hidden, weight, labels, b = make(CASE, (39,), 24, 83, dtype=torch.bfloat16, bias=True,
                                     ignore_frac=0, logit_std=2.0)  # fmt: skip
    labels[::4] = -100  # 30 counted rows of 39
    labels[1], labels[2], labels[3] = 0, 40, 82
    _check(oracle, _run(oracle, hidden, weight, labels, b, reduction="sum", z_loss=1e-3))
    assert spy == [1] and spy.plans[0].compact


def test_counted_rows_pass_only_where_it_pays():
    """Taken where it saves 8 % of the matmul work and leaves at most 40 % of the vocabulary
    under its accumulator (measured on an H200: faster with 10 % and 30 % of rows ignored,
    as fast at Llama-2 with 10 %), and only where it fits."""
    assert zi._compact_pays(8192, 4915, 152064, 3584)  # Qwen2.5, 40 % ignored
    assert zi._compact_pays(8192, 7373, 152064, 3584)  # Qwen2.5, 10 % ignored: saves ~0.1
    assert zi._compact_pays(32768, 19660, 128256, 4096)  # Llama-3 at 32K, 40 % ignored
    assert zi._compact_pays(8192, 5734, 32000, 4096)  # Llama-2, 30 %: 2M / V = 0.36
    assert not zi._compact_pays(8192, 7782, 152064, 3584)  # 5 % ignored: saves ~0.05
    assert not zi._compact_pays(8192, 8192, 152064, 3584)  # every row counted
    assert not zi._compact_pays(8192, 7373, 32000, 4096)  # Llama-2, 10 %: 2M / V = 0.46
    assert not zi._compact_pays(100, 50, 400, 4)  # (V - 2M) H / 2M = 12 < MIN_TAIL_COLS

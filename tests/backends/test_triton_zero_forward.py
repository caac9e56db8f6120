"""The zero-logits path's matmul forward (``backends/triton/zero_logits.py``:
:func:`lse_state_by_matmul`, :func:`~fused_ce_patch.backends.triton.kernels.lse_cols_kernel`)
under the Triton interpreter: the running LSE state against float64 at non-divisible sizes
(ragged last chunk, chunk rows padded for alignment), with bias, softcap and label smoothing;
the loss and gradients of the whole path against float64 and against the Triton forward; and
when it steps aside for the Triton forward.
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
from fused_ce_patch import fused_linear_cross_entropy  # noqa: E402
from fused_ce_patch.backends.base import LossSpec  # noqa: E402
from fused_ce_patch.backends.triton import zero_logits as zl  # noqa: E402
from fused_ce_patch.backends.triton import zero_logits_inplace as zi  # noqa: E402
from fused_ce_patch.backends.triton.launch import CUDA_LAUNCHERS  # noqa: E402

pytestmark = pytest.mark.usefixtures("seed", "one_thread")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # the TMA forward (tests/backends/test_triton_zero_tma.py) comes first where it applies
    monkeypatch.setattr(zl, "TMA_FORWARD", False)


@pytest.fixture
def spy(monkeypatch):
    """Records the runs of the matmul forward (their vocabulary chunk widths)."""
    widths = []
    original = CUDA_LAUNCHERS.lse_cols.__func__

    def wrapped(self, z, *args, **kw):
        widths.append(z.shape[1])
        return original(self, z, *args, **kw)

    monkeypatch.setattr(type(CUDA_LAUNCHERS), "lse_cols", wrapped)
    return widths


def _capped(z, softcap):
    return z if softcap is None else softcap * torch.tanh(z / softcap)


@pytest.mark.parametrize("softcap,bias,width", [(None, False, None), (7.0, True, 24),
                                                (None, True, 16), (3.0, False, 40)])
def test_state_against_float64(monkeypatch, softcap, bias, width):
    n, h, v = 37, 48, 203  # V not a multiple of any width: a ragged, padded last chunk
    monkeypatch.setattr(zi, "MAX_CHUNK_COLS", width)
    hid = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    b = torch.randn(v).bfloat16() if bias else None
    y = torch.randint(0, v, (n,))
    y[::5] = -100
    spec = LossSpec(ignore_index=-100, softcap=softcap, label_smoothing=0.1, z_loss=0.0)
    state = zl.lse_state_by_matmul(hid, w, b, y, spec, CUDA_LAUNCHERS)
    z = hid.double() @ w.double().t()
    if b is not None:
        z = z + b.double()
    s = _capped(z, softcap)
    lse = state[0].double() + state[1].double().log()
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-6, atol=1e-6)
    counted = y >= 0
    z_t = s.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    torch.testing.assert_close(state[2].double()[counted], z_t[counted], rtol=1e-6, atol=1e-6)
    assert (state[2][~counted] == 0).all()  # an ignored row never matches a column
    torch.testing.assert_close(state[3].double(), s.sum(-1), rtol=1e-5, atol=1e-5)


def _run(hid, w, b, y, **kw):
    hid = hid.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    loss = fused_linear_cross_entropy(hid, w, y, bias=b, backend="triton", logits_budget=0, **kw)
    grads = torch.autograd.grad(loss, [t for t in (hid, w, b) if t is not None])
    return loss.detach(), grads


@pytest.mark.parametrize("opts", [{}, {"softcap": 5.0, "label_smoothing": 0.1},
                                  {"z_loss": 1e-3, "ignore_index": 3}])
def test_loss_and_grads_equal_the_triton_forward(monkeypatch, spy, opts):
    n, h, v = 2, 64, 301
    hid = torch.randn(n, 19, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    b = torch.randn(v).bfloat16()
    y = torch.randint(0, v, (n, 19))
    y[0, :3] = opts.get("ignore_index", -100)
    monkeypatch.setattr(zi, "MAX_CHUNK_COLS", 24)
    got = _run(hid, w, b, y, **opts)
    assert spy and max(spy) == 24
    monkeypatch.setattr(zl, "MATMUL_FORWARD", False)
    n_calls = len(spy)
    want = _run(hid, w, b, y, **opts)
    assert len(spy) == n_calls  # the Triton forward ran
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
    for a, e in zip(got[1], want[1]):
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=1e-4)
    # and both against float64
    hd, wd, bd = (t.double().requires_grad_() for t in (hid, w, b))
    z = _capped(hd @ wd.t() + bd, opts.get("softcap")).reshape(-1, v)
    yy = y.reshape(-1)
    ii = opts.get("ignore_index", -100)
    per = F.cross_entropy(z, yy, reduction="none", ignore_index=ii,
                          label_smoothing=opts.get("label_smoothing", 0.0))
    if opts.get("z_loss"):
        per = per + opts["z_loss"] * torch.logsumexp(z, -1).square() * (yy != ii)
    ref = per.sum() / (yy != ii).sum()
    torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["no hidden grad", "float32", "mostly ignored", "off",
                                  "many rows per hidden unit"])
def test_steps_aside(monkeypatch, spy, case):
    n, h, v = 40, 32, 97
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    hid = torch.randn(n, h).to(dtype)
    w = torch.randn(v, h).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,))
    if case == "mostly ignored":
        y[: n // 2] = -100  # 50 % counted < MATMUL_FORWARD_MIN_COUNTED
    if case == "off":
        monkeypatch.setattr(zl, "MATMUL_FORWARD", False)
    if case == "many rows per hidden unit":
        monkeypatch.setattr(zi, "MAX_ROWS_PER_HIDDEN", 1)  # N / H = 40 / 32 > 1
    if case != "no hidden grad":
        hid.requires_grad_()
    fused_linear_cross_entropy(hid, w, y, backend="triton", logits_budget=0).backward()
    assert spy == []
    if case == "mostly ignored":  # and it runs with 60 % counted
        y[: int(0.4 * n)] = 5
        fused_linear_cross_entropy(hid, w, y, backend="triton", logits_budget=0)
        assert spy


def test_strided_labels(spy):
    """Labels that are a strided view (every other column of a [N, 2] tensor): the merge kernel
    reads labels with unit stride, so the path must pass a packed copy (a review found the
    loss 10 % off, and reads past a stride-0 tensor's storage)."""
    n, h, v = 24, 32, 100
    hid = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    y2 = torch.randint(0, v, (n, 2))
    for y in (y2[:, 1], torch.full((1,), 7).expand(n)):
        got = _run(hid, w, None, y)
        assert spy
        want = _run(hid, w, None, y.contiguous())
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        ref = F.cross_entropy(hid.double() @ w.double().t(), y)
        torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("masked", [8, 32])
def test_a_chunk_of_minus_inf_logits(monkeypatch, spy, masked):
    """A -inf bias over the first chunk(s) (tokens masked out): the running max starts finite,
    so no inf - inf, and the loss and gradients equal the Triton forward's."""
    n, h, v = 12, 16, 40  # H = 16: chunks of 8 columns
    hid = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    b = torch.zeros(v).bfloat16()
    b[:masked] = float("-inf")
    y = torch.randint(masked, v, (n,))
    got = _run(hid, w, b, y)
    assert spy
    monkeypatch.setattr(zl, "MATMUL_FORWARD", False)
    want = _run(hid, w, b, y)
    assert torch.isfinite(got[0])
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
    for a, e in zip(got[1][:2], want[1][:2]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=1e-4)


def test_no_buffer_under_no_grad(spy):
    """Under torch.no_grad no dH will be allocated, so the float32 chunk buffer would raise the
    peak: the Triton forward runs (``ctx.needs_input_grad`` ignores grad mode)."""
    hid = torch.randn(40, 32).bfloat16().requires_grad_()
    w = torch.randn(97, 32).bfloat16().requires_grad_()
    y = torch.randint(0, 97, (40,))
    with torch.no_grad():
        fused_linear_cross_entropy(hid, w, y, backend="triton", logits_budget=0)
    assert spy == []
    fused_linear_cross_entropy(hid, w, y, backend="triton", logits_budget=0)
    assert spy

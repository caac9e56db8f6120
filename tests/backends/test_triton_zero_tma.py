"""The zero-logits path's TMA forward (``backends/triton/zero_logits.py``:
:func:`tma_forward_rows`; :func:`~fused_ce_patch.backends.triton.kernels.lse_tma_kernel`,
:func:`~fused_ce_patch.backends.triton.kernels.lse_tma_runs_kernel` and
:func:`~fused_ce_patch.backends.triton.kernels.lse_merge_kernel` through
``CudaLaunchers.lse_tma``) under the Triton interpreter: the running LSE state against float64
at non-divisible sizes (ragged row and column blocks, several vocabulary slices, a ragged last
slice; runs of several column blocks, a last run past the vocabulary), with bias, softcap and
label smoothing; the loss and gradients of the whole path against float64 and against the
Triton forward; a block of -inf logits; the 2 GiB operand limit; and when it steps aside.
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
from fused_ce_patch.backends.triton import launch  # noqa: E402
from fused_ce_patch.backends.triton import zero_logits as zl  # noqa: E402
from fused_ce_patch.backends.triton import zero_logits_inplace as zi  # noqa: E402
from fused_ce_patch.backends.triton.launch import CUDA_LAUNCHERS  # noqa: E402

pytestmark = pytest.mark.usefixtures("seed", "one_thread")
if not launch._triton_has_tma_loops():
    pytest.skip("this Triton has no host tensor descriptors or warp-specialised loops",
                allow_module_level=True)  # fmt: skip


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def spy(monkeypatch):
    """Records the runs of the TMA forward (the rows of each ``h2``), the launches of its
    per-block kernel (the columns of each vocabulary slice) and of its per-run kernel
    (``(n_cols, run_tiles)``)."""
    runs, slices, run_launches = [], [], []
    original = CUDA_LAUNCHERS.lse_tma.__func__

    class Spy:
        def __init__(self, kernel, record):
            self.kernel, self.record = kernel, record

        def __getitem__(self, grid):
            def run(*args, **kw):
                self.record(args)
                return self.kernel[grid](*args, **kw)

            return run

    def wrapped(self, h2, *args, **kw):
        runs.append(h2.shape[0])
        return original(self, h2, *args, **kw)

    monkeypatch.setattr(type(CUDA_LAUNCHERS), "lse_tma", wrapped)
    monkeypatch.setattr(launch, "lse_tma_kernel",
                        Spy(launch.lse_tma_kernel, lambda a: slices.append(a[6])))  # n_cols
    monkeypatch.setattr(launch, "lse_tma_runs_kernel",
                        Spy(launch.lse_tma_runs_kernel,
                            lambda a: run_launches.append((a[6], a[11]))))  # fmt: skip
    return runs, slices, run_launches


def _capped(z, softcap):
    return z if softcap is None else softcap * torch.tanh(z / softcap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap,bias,part_blocks", [(None, False, None), (7.0, True, 2),
                                                      (None, True, 3), (3.0, False, 1)])
def test_state_against_float64(monkeypatch, spy, dtype, softcap, bias, part_blocks):
    # 37 rows: a ragged row block of 16; V = 203: a ragged column block of 32, and with
    # part_blocks = 2 or 3 blocks a slice, a ragged last slice
    n, h, v = 37, 48, 203
    if part_blocks:
        monkeypatch.setattr(launch, "TMA_PART_BYTES", 16 * n * part_blocks)
    hid = torch.randn(n, h).to(dtype)
    w = (torch.randn(v, h) / h**0.5).to(dtype)
    b = torch.randn(v).to(dtype) if bias else None
    y = torch.randint(0, v, (n,))
    y[::5] = -100
    spec = LossSpec(ignore_index=-100, softcap=softcap, label_smoothing=0.1, z_loss=0.0)
    state = zl._initial_state(n, hid.device)
    CUDA_LAUNCHERS.lse_tma(hid, w, b, y, state, spec)
    want_slices = -(-v // (32 * (part_blocks or 7)))
    assert len(spy[1]) == want_slices and sum(spy[1]) == v
    _check_state(state, hid, w, b, y, softcap)


def _check_state(state, hid, w, b, y, softcap):
    """``state`` (max, sum of exp, target logit, sum of logits per row) against float64's;
    returns the state's LSE."""
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
    return lse


@pytest.mark.parametrize("softcap,bias,part_blocks", [(None, False, None), (7.0, True, 2),
                                                      (None, True, 3), (3.0, False, 1),
                                                      (None, False, 5)])  # fmt: skip
def test_runs_state_against_float64(monkeypatch, spy, softcap, bias, part_blocks):
    """The per-run kernel (forced: ``TMA_RUNS_MIN_ROWS_PER_HIDDEN`` 0): one launch over the
    whole vocabulary, 7 blocks of 32 columns in runs of 1 (7 runs), 4 (2 runs), 3 (3 runs),
    7 (1 run) or 2 blocks (4 runs, fewer than the 5 blocks of partials room); with runs of 4, 3
    or 2 blocks the last run reaches past the vocabulary. Against float64 and the per-block
    kernel."""
    monkeypatch.setattr(launch, "TMA_RUNS_MIN_ROWS_PER_HIDDEN", 0)
    n, h, v = 37, 48, 203
    if part_blocks:
        monkeypatch.setattr(launch, "TMA_PART_BYTES", 16 * n * part_blocks)
    hid = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    b = torch.randn(v).bfloat16() if bias else None
    y = torch.randint(0, v, (n,))
    y[::5] = -100
    spec = LossSpec(ignore_index=-100, softcap=softcap, label_smoothing=0.1, z_loss=0.0)
    state = zl._initial_state(n, hid.device)
    CUDA_LAUNCHERS.lse_tma(hid, w, b, y, state, spec)
    run_tiles = -(-7 // (part_blocks or 7))
    assert spy[1] == [] and spy[2] == [(v, run_tiles)]
    lse = _check_state(state, hid, w, b, y, softcap)
    monkeypatch.setattr(launch, "TMA_RUNS_MIN_ROWS_PER_HIDDEN", 10**9)
    blocks = zl._initial_state(n, hid.device)
    CUDA_LAUNCHERS.lse_tma(hid, w, b, y, blocks, spec)
    assert spy[1] and len(spy[2]) == 1
    lse_blocks = blocks[0].double() + blocks[1].double().log()
    torch.testing.assert_close(lse, lse_blocks, rtol=1e-6, atol=1e-6)


def test_runs_beyond_the_rows_per_hidden_rule(monkeypatch, spy):
    """Past ``TMA_RUNS_MIN_ROWS_PER_HIDDEN`` rows per hidden unit the forward takes the per-run
    kernel, up to ``TMA_MAX_ROWS_PER_HIDDEN``; the loss and gradients are float64's."""
    n, h, v = 96, 16, 131  # N / H = 6
    monkeypatch.setattr(launch, "TMA_RUNS_MIN_ROWS_PER_HIDDEN", 5)
    monkeypatch.setattr(zl, "TMA_MAX_ROWS_PER_HIDDEN", 6)
    monkeypatch.setattr(zi, "MAX_ROWS_PER_HIDDEN_TMA", 6)  # the in-place backward too
    hid = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    y = torch.randint(0, v, (n,))
    y[::9] = -100
    got = _run(hid, w, None, y, label_smoothing=0.05)
    assert spy[0] == [n] and spy[1] == [] and len(spy[2]) == 1
    hd, wd = (t.double().requires_grad_() for t in (hid, w))
    ref = F.cross_entropy(hd @ wd.t(), y, label_smoothing=0.05)
    torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-6)
    for a, e in zip(got[1], torch.autograd.grad(ref, (hd, wd))):
        assert (a.double() - e).norm() <= 1e-2 * e.norm()
    monkeypatch.setattr(zl, "TMA_MAX_ROWS_PER_HIDDEN", 5)  # N / H = 6 > 5: steps aside
    _run(hid, w, None, y)
    assert spy[0] == [n]


def _run(hid, w, b, y, **kw):
    hid = hid.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    loss = fused_linear_cross_entropy(hid, w, y, bias=b, backend="triton", logits_budget=0, **kw)
    grads = torch.autograd.grad(loss, [t for t in (hid, w, b) if t is not None])
    return loss.detach(), grads


@pytest.mark.parametrize("opts", [{}, {"softcap": 5.0, "label_smoothing": 0.1},
                                  {"z_loss": 1e-3, "ignore_index": 3, "reduction": "sum"}])
def test_loss_and_grads_equal_the_triton_forward(monkeypatch, spy, opts):
    n, h, v = 2, 64, 301
    hid = torch.randn(n, 19, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    b = torch.randn(v).bfloat16()
    y = torch.randint(0, v, (n, 19))
    y[0, :3] = opts.get("ignore_index", -100)
    monkeypatch.setattr(launch, "TMA_PART_BYTES", 16 * 38 * 4)  # 3 slices
    got = _run(hid, w, b, y, **opts)
    assert spy[0] == [38] and len(spy[1]) == 3  # every row, three slices
    monkeypatch.setattr(zl, "TMA_FORWARD", False)
    monkeypatch.setattr(zl, "MATMUL_FORWARD", False)
    want = _run(hid, w, b, y, **opts)
    assert spy[0] == [38]  # the Triton forward ran
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
    for a, e in zip(got[1], want[1]):
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=1e-4)
    # and against float64
    hd, wd, bd = (t.double().requires_grad_() for t in (hid, w, b))
    z = _capped(hd @ wd.t() + bd, opts.get("softcap")).reshape(-1, v)
    yy = y.reshape(-1)
    ii = opts.get("ignore_index", -100)
    per = F.cross_entropy(z, yy, reduction="none", ignore_index=ii,
                          label_smoothing=opts.get("label_smoothing", 0.0))
    if opts.get("z_loss"):
        per = per + opts["z_loss"] * torch.logsumexp(z, -1).square() * (yy != ii)
    ref = per.sum() if opts.get("reduction") == "sum" else per.sum() / (yy != ii).sum()
    torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(ref, (hd, wd, bd))
    for a, e in zip(got[1], grads):
        assert (a.double() - e).norm() <= 1e-2 * e.norm()


@pytest.mark.parametrize("runs", [False, True], ids=["blocks", "runs"])
@pytest.mark.parametrize("masked", [32, 64, 70])
def test_blocks_of_minus_inf_logits(monkeypatch, spy, masked, runs):
    """A -inf bias over the first column block(s), or a whole slice or run (tokens masked
    out): each block's (each run's) max is kept finite, so no inf - inf, and the loss and
    gradients equal the Triton forward's."""
    n, h, v = 12, 16, 100
    monkeypatch.setattr(launch, "TMA_PART_BYTES", 16 * n * 2)  # slices / runs of 64 columns
    if runs:
        monkeypatch.setattr(launch, "TMA_RUNS_MIN_ROWS_PER_HIDDEN", 0)
    hid = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    b = torch.zeros(v).bfloat16()
    b[:masked] = float("-inf")
    y = torch.randint(masked, v, (n,))
    got = _run(hid, w, b, y)
    assert spy[0] and bool(spy[2]) == runs
    monkeypatch.setattr(zl, "TMA_FORWARD", False)
    monkeypatch.setattr(zl, "MATMUL_FORWARD", False)
    want = _run(hid, w, b, y)
    assert torch.isfinite(got[0])
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
    for a, e in zip(got[1][:2], want[1][:2]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=1e-4)


def test_strided_labels(spy):
    """Labels that are a strided view, or a stride-0 expand: the kernel reads them with unit
    stride from a packed copy."""
    n, h, v = 24, 32, 100
    hid = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    y2 = torch.randint(0, v, (n, 2))
    for y in (y2[:, 1], torch.full((1,), 7).expand(n)):
        got = _run(hid, w, None, y)
        assert spy[0]
        want = _run(hid, w, None, y.contiguous())
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        ref = F.cross_entropy(hid.double() @ w.double().t(), y)
        torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["float32", "mostly ignored", "off", "rows not 16-byte aligned",
                                  "no lse_tma launcher", "gpu without TMA",
                                  "many rows per hidden unit", "expanded rows"])
def test_steps_aside(monkeypatch, spy, case):
    n, h, v = 40, 32, 97
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    hid = torch.randn(n, h).to(dtype).requires_grad_()
    w = torch.randn(v, h).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,))
    if case == "mostly ignored":
        y[: n // 2] = -100  # 50 % counted < MATMUL_FORWARD_MIN_COUNTED
    if case == "off":
        monkeypatch.setattr(zl, "TMA_FORWARD", False)
    if case == "rows not 16-byte aligned":
        hid = torch.randn(n, h + 4).bfloat16()[:, :h].requires_grad_()  # 72-byte rows
    if case == "no lse_tma launcher":
        monkeypatch.delattr(type(CUDA_LAUNCHERS), "lse_tma")
    if case == "gpu without TMA":
        monkeypatch.setattr(zl, "tma_device", lambda device: False)
    if case == "many rows per hidden unit":
        monkeypatch.setattr(zl, "TMA_MAX_ROWS_PER_HIDDEN", 1)  # N / H = 40 / 32 > 1
    if case == "expanded rows":  # stride 0: TMA wants rows that do not overlap
        hid = torch.randn(1, h).bfloat16().expand(n, h).requires_grad_()
    fused_linear_cross_entropy(hid, w, y, backend="triton", logits_budget=0).backward()
    assert spy[0] == []
    if case == "mostly ignored":  # and it runs with 60 % counted
        y[: int(0.4 * n)] = 5
        fused_linear_cross_entropy(hid, w, y, backend="triton", logits_budget=0)
        assert spy[0] == [n]


class _Operand:
    """Stands in for a tensor of ``shape`` and ``stride`` (bfloat16, 16-byte aligned start)
    too large to allocate: :func:`launch.tma_operands` reads only these."""

    def __init__(self, shape, stride):
        self.shape, self._stride = shape, stride

    def stride(self, dim):
        return self._stride[dim]

    def element_size(self):
        return 2

    def data_ptr(self):
        return 1 << 20


@pytest.mark.parametrize("rows,cols,want", [
    (152064, 8192, False),  # a 2.3 GiB lm_head: Triton 3.9's 32-bit extent sum would wrap
    (131072, 8192, False),  # exactly 2**31 bytes: one more than the limit
    (131072, 8184, True),   # rows 8192 apart, the last one short: 2**31 - 16 bytes
    (128256, 8192, True),   # Llama-3-70B's lm_head, 1.96 GiB
])  # fmt: skip
def test_tma_operands_stay_below_two_gib(rows, cols, want):
    assert launch.tma_operands(_Operand((rows, cols), (8192, 1))) is want


@pytest.mark.parametrize("case", ["no hidden grad", "no grad mode"])
def test_runs_where_the_matmul_forward_does_not(spy, case):
    """No transient logits: it needs no dH-sized room, so it runs without a gradient of hidden
    and under ``torch.no_grad`` (where the matmul forward steps aside)."""
    n, h, v = 150, 16, 97
    hid = torch.randn(n, h).bfloat16().requires_grad_(case != "no hidden grad")
    w = (torch.randn(v, h) / h**0.5).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,))
    if case == "no grad mode":
        with torch.no_grad():
            loss = fused_linear_cross_entropy(hid, w, y, backend="triton", logits_budget=0)
    else:
        loss = fused_linear_cross_entropy(hid, w, y, backend="triton", logits_budget=0)
    assert spy[0] == [n]
    ref = F.cross_entropy(hid.double() @ w.double().t(), y)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capability,smem,hip,version,want", [
    ((9, 0), 232448, None, "3.6.0", True), ((9, 0), 232448, None, "3.10.1+git", True),
    ((9, 0), 232448, None, "3.5.1", False), ((10, 0), 232448, None, "3.6.0", False),
    ((8, 0), 166912, None, "3.6.0", False), ((12, 0), 101376, None, "3.6.0", False),
    ((9, 0), 101376, None, "3.6.0", False), ((9, 4), 232448, "6.2", "3.6.0", False),
    ((9, 0), 232448, None, "main", False),
])  # fmt: skip
def test_tma_device(monkeypatch, capability, smem, hip, version, want):
    import triton

    launch.tma_device.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(launch, "max_shared_mem", lambda device: smem)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(triton, "__version__", version)
    try:
        assert launch.tma_device(torch.device("cuda", 0)) is want
        assert launch.tma_device(torch.device("cpu")) is True  # the interpreter
    finally:
        launch.tma_device.cache_clear()


def test_tma_device_needs_a_triton_with_tma_loops(monkeypatch):
    """A Triton without ``tl.range(..., warp_specialize=)`` (older releases) keeps the other
    forwards instead of failing to compile."""
    import triton.language as tl

    class OldRange:
        def __init__(self, arg1, arg2=None, step=None, num_stages=None):
            pass

    launch.tma_device.cache_clear()
    monkeypatch.setattr(tl, "range", OldRange)
    try:
        assert launch.tma_device(torch.device("cpu")) is False
    finally:
        launch.tma_device.cache_clear()


@pytest.mark.parametrize("runs", [False, True], ids=["blocks", "runs"])
def test_row_groups_keep_the_partials_within_their_bytes(monkeypatch, spy, runs):
    """More rows than one 16-byte block of partials each allows: the rows run in groups, the
    partial buffer stays within ``TMA_PART_BYTES``, and the loss is float64's. The kernel is
    the one the whole ``N / H`` chooses (runs: 50 / 16 > 3; each group's 20 / 16 is not)."""
    n, h, v = 50, 16, 97
    monkeypatch.setattr(launch, "TMA_PART_BYTES", 16 * 20)  # 20 rows a group: 20, 20, 10
    monkeypatch.setattr(launch, "TMA_RUNS_MIN_ROWS_PER_HIDDEN", 3 if runs else 10**9)
    sizes = []
    empty = torch.empty

    def spy_empty(*shape, **kw):
        t = empty(*shape, **kw)
        if kw.get("dtype") == torch.float32 and len(shape) == 1:
            sizes.append(t.numel() * 4)
        return t

    monkeypatch.setattr(launch.torch, "empty", spy_empty)
    hid = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    y = torch.randint(0, v, (n,))
    y[::7] = -100
    got = _run(hid, w, None, y)
    assert spy[0][0] == n and len(spy[0]) == 4  # the whole, then three groups
    assert (len(spy[2]), bool(spy[1])) == ((3, False) if runs else (0, True))
    assert sizes and max(sizes) <= 16 * 20
    counted = y >= 0
    ref = F.cross_entropy(hid.double() @ w.double().t(), y)
    torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-6)
    assert counted.sum() < n

"""Backend-generic semantics suite: what every backend must compute (docs/design.md §1, §2, §3).

Every test here takes a ``case`` fixture (which backend, which ``logits_budget``, which device,
full or small shapes) and compares the backend with the float64 oracle of ``tests/conftest.py``
(materialised float64 logits, softcap, ``F.cross_entropy``, z-loss), computed in the test —
never with another backend. Inputs are fresh random tensors each run (the ``seed`` fixture
prints the seed; ``FUSED_CE_TEST_SEED`` replays it).

How a backend plugs in — one small module ``tests/backends/test_<name>.py``::

    import pytest

    from semantics import *  # noqa: F403  (collects every test_* of this suite)
    from semantics import Case

    CASES = [
        Case("triton", logits_budget=0, small=True),      # zero-logits kernels
        Case("triton", logits_budget=None, small=True),   # the backend's default budget
    ]

    @pytest.fixture(params=CASES, ids=str)
    def case(request):
        request.param.skip_if_unavailable()   # pytest.skip with the registry's reason
        return request.param

``Case(small=True)`` shrinks every shape (for the Triton interpreter); ``dtypes=`` lists the
input dtypes the backend accepts (tests needing float64, e.g. ``gradcheck``, skip with a reason
otherwise); ``device=`` places the tensors. Tests that only make sense for one backend (its
chunk plan, its memory) go in that backend's module, below the import.

Tolerances (relative error of the whole tensor, ``||a - b|| / ||b||``) are stated once in
:data:`TOL`; float16/bfloat16 (and float32 with p(target) ~= 0.999) are held to "no worse than
PyTorch's own path" instead (:data:`LOWP_SLACK` and the floors below it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fused_ce_patch import fused_linear_cross_entropy
from fused_ce_patch.backends import registry
from fused_ce_patch.numerics import relative_error

pytestmark = pytest.mark.usefixtures("seed", "one_thread")

#: Relative error allowed against the float64 oracle, per input dtype.
TOL = {torch.float64: 1e-10, torch.float32: 3e-5}
#: Against PyTorch's own path (same inputs, linear in the input dtype, float32 cross-entropy)
#: our error may exceed its error by this factor, plus two floors: float32's own resolution of
#: the per-position loss, one ulp of 1.0 (2**-23) in absolute terms (for p(target) ~= 0.999 the
#: loss is log(1 + tail) with tail ~= 1e-3: rounding 1 + tail is a relative error of up to
#: ~1e-4 in any float32 implementation, and which one rounds luckier varies row by row), and
#: a relative 1e-6, below which float32 errors are summation-order noise.
LOWP_SLACK = 1.25
LOWP_ABS_FLOOR = 2.0**-23
LOWP_REL_FLOOR = 1e-6

REDUCTIONS = ("none", "sum", "mean")
ALL_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Case:
    """One configuration of one backend under test.

    Attributes:
        backend: registered backend name passed as ``backend=``.
        logits_budget: passed as ``logits_budget=`` (None = the backend's default).
        device: where inputs are created.
        small: use small shapes everywhere (slow backends, e.g. the Triton interpreter).
        dtypes: input dtypes the backend accepts.
    """

    backend: str
    logits_budget: int | None = None
    device: str = "cpu"
    small: bool = False
    dtypes: tuple = ALL_FLOATS

    def __str__(self):
        size = "-small" if self.small else ""
        return f"{self.backend}-budget={self.logits_budget}{size}"

    def loss(self, hidden, weight, labels, **kw):
        return fused_linear_cross_entropy(
            hidden, weight, labels, backend=self.backend, logits_budget=self.logits_budget, **kw
        )

    def pick(self, full, small):
        return small if self.small else full

    @property
    def exact(self) -> torch.dtype:
        """The most precise dtype the backend accepts (float64 or float32)."""
        return torch.float64 if torch.float64 in self.dtypes else torch.float32

    def require(self, dtype):
        if dtype not in self.dtypes:
            pytest.skip(f"backend {self.backend!r} does not take {dtype} inputs")

    def skip_if_unavailable(self):
        for name, ok, why in registry.explain(torch.device(self.device), torch.float32):
            if name == self.backend and not ok:
                pytest.skip(f"backend {self.backend!r} unavailable here: {why}")


# -- inputs ---------------------------------------------------------------------------------


def make(
    case,
    lead,
    h,
    v,
    *,
    dtype=torch.float32,
    bias=False,
    logit_std=1.0,
    ignore_frac=0.25,
    ignore_index=-100,
    grad=True,
):
    """Random ``hidden [*lead, h]``, ``weight [v, h]``, ``labels [*lead]`` (+ ``bias [v]``).

    Raw logits have standard deviation about ``logit_std``; about ``ignore_frac`` of the labels
    are ``ignore_index`` (never all of them unless ``ignore_frac == 1``).
    """
    dev = case.device
    hidden = torch.randn(*lead, h, dtype=torch.float64, device=dev)
    weight = torch.randn(v, h, dtype=torch.float64, device=dev) * (logit_std / math.sqrt(h))
    labels = torch.randint(0, v, lead, device=dev)
    if ignore_index is not None and ignore_index >= 0:
        # keep the ignored value out of the counted labels, so the fraction is the one asked
        labels = torch.where(labels == ignore_index, (labels + 1) % v, labels)
    if ignore_frac:
        drop = torch.rand(lead, device=dev) < ignore_frac
        if ignore_frac < 1 and drop.all() and labels.numel():
            drop.view(-1)[0] = False
        labels = labels.masked_fill(drop, ignore_index)
    b = torch.randn(v, dtype=torch.float64, device=dev) * 0.5 if bias else None
    out = [hidden.to(dtype), weight.to(dtype), labels, None if b is None else b.to(dtype)]
    for t in (out[0], out[1], out[3]):
        if t is not None:
            t.requires_grad_(grad)
    return out


def _leaves(hidden, weight, bias):
    return [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]


def _grads(loss_fn, inputs, upstream=None):
    """Gradients of ``loss_fn(*inputs)`` (weighted by ``upstream`` for a tensor result)."""
    out = loss_fn(*inputs)
    if upstream is None:
        upstream = torch.ones_like(out)
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    return out, torch.autograd.grad(out, leaves, upstream.to(out.dtype))


def check_against_oracle(case, oracle, hidden, weight, labels, bias=None, tol=None, **opts):
    """Loss and every gradient of ``case`` against the float64 oracle on the same inputs."""
    tol = tol if tol is not None else TOL[hidden.dtype]
    reduction = opts.get("reduction", "mean")
    ours = case.loss(hidden, weight, labels, bias=bias, **opts)
    ref = oracle.loss(hidden, weight, labels, bias=bias, **opts)
    assert ours.shape == ref.shape
    assert ours.dtype == (torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    # a random upstream gradient (some exactly 0) also checks the scaling in backward
    if reduction == "none":
        up = torch.rand(ref.shape, dtype=torch.float64, device=ref.device) * 2 - 0.5
        up = up.masked_fill(torch.rand(ref.shape, device=ref.device) < 0.2, 0.0)
    else:
        up = torch.tensor(0.7, dtype=torch.float64)
    assert oracle.rel_err(ours, ref) <= tol, (oracle.rel_err(ours, ref), ours, ref)
    leaves = _leaves(hidden, weight, bias)
    if not leaves:
        return ours, ref
    g_ours = torch.autograd.grad(ours, leaves, up.to(ours.dtype).to(ours.device))
    g_ref = torch.autograd.grad(ref, leaves, up.to(ref.device))
    for name, a, b in zip(("first", "second", "third"), g_ours, g_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.isfinite(a).all()
        err = oracle.rel_err(a, b)
        assert err <= tol, f"{name} gradient: relative error {err:.3g} > {tol:.1g}"
    return ours, ref


# -- docs/design.md §1 check values --------------------------------------------------------------

Z = [0.0, math.log(2), math.log(3), math.log(4)]
CHECK_VALUES = [
    ({}, 1.2039728043259361),
    ({"label_smoothing": 0.1}, 1.2343826874340484),
    ({"z_loss": 1e-4}, 1.204502994136984),
]


@pytest.mark.parametrize("opts,expected", CHECK_VALUES, ids=["plain", "smoothing", "z_loss"])
def test_check_values(case, opts, expected):
    dtype = case.exact
    h = 16  # logits = weight[:, 0]: hidden is e_0; the other columns are noise
    weight = torch.randn(4, h, dtype=dtype, device=case.device)
    weight[:, 0] = torch.tensor(Z, dtype=dtype)
    hidden = torch.zeros(3, h, dtype=dtype, device=case.device)
    hidden[:, 0] = 1.0
    labels = torch.tensor([2, -100, 2], device=case.device)
    for reduction, want in (("mean", expected), ("sum", 2 * expected)):
        got = case.loss(hidden, weight, labels, reduction=reduction, **opts)
        assert abs(float(got) - want) <= 1e-12 + TOL[dtype] * want, (reduction, float(got), want)
    per = case.loss(hidden, weight, labels, reduction="none", **opts)
    assert per[1] == 0 and abs(float(per[0]) - expected) <= 1e-12 + TOL[dtype] * expected


# -- shapes that break assumptions ----------------------------------------------------------

SHAPES = {
    # id: (full (lead, H, V), small (lead, H, V))
    "N1-oddH-primeV": (((1,), 7, 1009), ((1,), 5, 67)),
    "N67-primeV": (((67,), 33, 1009), ((13,), 7, 97)),
    "3d-oddH": (((2, 29), 17, 257), ((2, 5), 9, 31)),
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_shapes(case, oracle, shape, reduction):
    lead, h, v = case.pick(*SHAPES[shape])
    hidden, weight, labels, bias = make(case, lead, h, v, ignore_frac=0.2 if lead[0] > 1 else 0)
    check_against_oracle(case, oracle, hidden, weight, labels, reduction=reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ignored_block_bigger_than_a_chunk(case, oracle, reduction):
    """Rows 0..k-1 ignored (more rows than one chunk), the rest counted — and the reverse."""
    lead, h, v = case.pick(((67,), 33, 1009), ((13,), 7, 97))
    hidden, weight, labels, _ = make(case, lead, h, v, ignore_frac=0)
    n = lead[0]
    for block in (slice(0, 2 * n // 3), slice(n // 3, n), slice(1, n - 1)):
        y = labels.clone()
        y[block] = -100
        ours, _ = check_against_oracle(case, oracle, hidden, weight, y, reduction=reduction)
        if reduction == "none":
            assert (ours[block] == 0).all()
            assert (ours[y != -100] > 0).all()
    # gradients of ignored rows are exactly zero
    y = labels.clone()
    y[: 2 * n // 3] = -100
    dh = torch.autograd.grad(case.loss(hidden, weight, y, reduction=reduction).sum(), hidden)[0]
    assert (dh[: 2 * n // 3] == 0).all() and (dh[2 * n // 3 :] != 0).any()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 5.0}])
def test_all_ignored(case, reduction, opts):
    lead, h, v = case.pick(((4, 9), 16, 101), ((2, 3), 8, 17))
    hidden, weight, labels, bias = make(case, lead, h, v, bias=True, ignore_frac=1.0)
    out = case.loss(hidden, weight, labels, bias=bias, reduction=reduction, **opts)
    assert out.shape == (labels.shape if reduction == "none" else ())
    assert (out == 0).all() and not out.isnan().any()
    grads = torch.autograd.grad(out.sum(), [hidden, weight, bias])
    for g in grads:
        assert (g == 0).all()
    if reduction != "none":  # stock: 0 / 0
        out = case.loss(hidden, weight, labels, bias=bias, reduction=reduction,
                        num_items_in_batch=0, **opts)
        assert out.isnan()
        for g in torch.autograd.grad(out, [hidden, weight, bias]):
            assert (g == 0).all()


def test_empty_input(case):
    hidden, weight, labels, _ = make(case, (0,), 8, 17, ignore_frac=0)
    for reduction in REDUCTIONS:
        out = case.loss(hidden, weight, labels, reduction=reduction)
        assert out.shape == ((0,) if reduction == "none" else ()) and (out == 0).all()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_shift_sequence_length_one(case, reduction):
    """With T = 1 the only position predicts nothing: 0.0, zero grads."""
    hidden, weight, labels, _ = make(case, (3, 1), 8, 17, ignore_frac=0)
    out = case.loss(hidden, weight, labels, shift=True, reduction=reduction)
    assert out.shape == ((3, 1) if reduction == "none" else ()) and (out == 0).all()
    dh, dw = torch.autograd.grad(out.sum(), [hidden, weight])
    assert (dh == 0).all() and (dw == 0).all()


def test_shift_equals_shifting_the_labels(case, oracle):
    lead, h, v = case.pick(((3, 17), 16, 211), ((2, 6), 8, 29))
    hidden, weight, labels, _ = make(case, lead, h, v)
    shifted = torch.cat([labels[:, 1:], labels.new_full((lead[0], 1), -100)], dim=1)
    for reduction in REDUCTIONS:
        a = case.loss(hidden, weight, labels, shift=True, reduction=reduction)
        b = case.loss(hidden, weight, shifted, reduction=reduction)
        assert oracle.rel_err(a, b) <= TOL[torch.float32]
        if reduction == "none":
            assert (a[:, -1] == 0).all()


# -- every option and the combinations that break naive code --------------------------------

OPTIONS = {
    "plain": {},
    "bias": {"bias": True},
    # raw logits spanning about ±200: z*tanh(z/c) or an unstable softcap is visibly wrong
    "softcap-200": {"softcap": 30.0, "logit_std": 80.0},
    "no-softcap-200": {"logit_std": 80.0},
    "smoothing+ignore": {"label_smoothing": 0.1, "ignore_frac": 0.4},
    "z_loss": {"z_loss": 1e-2},
    "shift": {"shift": True},
    "ignore_index=3": {"ignore_index": 3, "ignore_frac": 0.3},
    "everything": {
        "bias": True,
        "softcap": 30.0,
        "logit_std": 80.0,
        "label_smoothing": 0.1,
        "z_loss": 1e-3,
        "shift": True,
        "ignore_frac": 0.3,
    },
}
_MAKE_KEYS = ("bias", "logit_std", "ignore_frac", "ignore_index")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("option", OPTIONS)
def test_options(case, oracle, option, reduction):
    opts = dict(OPTIONS[option])
    make_kw = {k: opts.pop(k) for k in _MAKE_KEYS if k in opts}
    if "ignore_index" in make_kw:
        opts["ignore_index"] = make_kw["ignore_index"]
    lead, h, v = case.pick(((3, 23), 32, 509), ((2, 7), 8, 53))
    hidden, weight, labels, bias = make(case, lead, h, v, **make_kw)
    if make_kw.get("logit_std", 1) > 50:
        raw = hidden.detach().double() @ weight.detach().double().t()
        assert raw.abs().max() > 150, "inputs meant to span about ±200"
    check_against_oracle(case, oracle, hidden, weight, labels, bias, reduction=reduction, **opts)


NUM_ITEMS = {
    "int": lambda n: n,
    "tensor-int64": lambda n: torch.tensor(n),
    "tensor-int32": lambda n: torch.tensor(n, dtype=torch.int32),
    "tensor-float32": lambda n: torch.tensor(float(n)),
    "tensor-float64": lambda n: torch.tensor(float(n), dtype=torch.float64),
}


@pytest.mark.parametrize("reduction", ("sum", "mean"))
@pytest.mark.parametrize("kind", NUM_ITEMS)
def test_num_items_in_batch(case, oracle, kind, reduction):
    lead, h, v = case.pick(((2, 19), 16, 131), ((2, 5), 8, 29))
    hidden, weight, labels, _ = make(case, lead, h, v)
    # a gradient-accumulation denominator larger than this micro-batch's count
    n = int((labels != -100).sum()) * 3 + 1
    num = NUM_ITEMS[kind](n)
    if isinstance(num, torch.Tensor):
        num = num.to(case.device)
    check_against_oracle(
        case, oracle, hidden, weight, labels, reduction=reduction, num_items_in_batch=num
    )
    mean = case.loss(hidden, weight, labels, reduction="sum") / n
    got = case.loss(hidden, weight, labels, reduction=reduction, num_items_in_batch=num)
    assert oracle.rel_err(got, mean) <= TOL[torch.float32]


#: Values of num_items_in_batch where stock's ``sum / n`` is not an ordinary mean.
EDGE_NUM_ITEMS = {
    "0": 0,
    "-0.0": -0.0,
    "nan": math.nan,
    "inf": math.inf,
    "-3": -3,
    "tensor-0": lambda: torch.tensor(0),
    "tensor-nan": lambda: torch.tensor(math.nan),
    "tensor[1]-(-2.5)-float64": lambda: torch.tensor([-2.5], dtype=torch.float64),
}


def assert_same_ieee(a, b, tol, what):
    """NaN and ±inf at the same places, finite entries within ``tol`` (relative)."""
    a, b = a.detach().double().cpu().reshape(b.shape), b.detach().double().cpu()
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN at other places: {a} vs {b}"
    assert torch.equal(a.isposinf(), b.isposinf()) and torch.equal(a.isneginf(), b.isneginf()), (
        f"{what}: inf at other places: {a} vs {b}")
    fin = b.isfinite()
    if fin.any() and b[fin].abs().max() > 0:
        err = relative_error(a[fin], b[fin])
        assert err <= tol, f"{what}: relative error {err:.3g}"
    else:
        assert (a[fin] == 0).all(), what


@pytest.mark.parametrize("upstream", [0.7, 0.0])
@pytest.mark.parametrize("value", EDGE_NUM_ITEMS)
def test_num_items_in_batch_every_value_as_stock(case, value, upstream):
    """``sum / num_items_in_batch`` as transformers computes it, for 0, -0.0, NaN, inf and
    negative divisors too (inf, NaN, a negative loss), with autograd's gradient of that
    division over ``F.cross_entropy(reduction="sum")`` (NaN at an inf-scaled target)."""
    lead, h, v = case.pick(((2, 7), 16, 53), ((2, 5), 8, 17))
    dtype = case.exact
    hidden, weight, labels, bias = make(case, lead, h, v, dtype=dtype, bias=True)
    n = EDGE_NUM_ITEMS[value]
    n = n() if callable(n) else n
    if isinstance(n, torch.Tensor):
        n = n.to(case.device)
    got = case.loss(hidden, weight, labels, bias=bias, shift=True, num_items_in_batch=n)
    assert got.shape == () and got.dtype == (torch.float64 if dtype == torch.float64
                                             else torch.float32)
    up = torch.tensor(upstream, dtype=got.dtype, device=got.device)
    g_got = torch.autograd.grad(got, [hidden, weight, bias], up)
    # stock: materialised float64 logits, F.cross_entropy(sum) / n, autograd
    z = hidden.double() @ weight.double().t() + bias.double()
    y = torch.cat([labels[:, 1:], labels.new_full((lead[0], 1), -100)], dim=1)
    total = F.cross_entropy(z.reshape(-1, v), y.reshape(-1), reduction="sum")
    want = total / (n.to(torch.float64) if isinstance(n, torch.Tensor) else n)
    g_want = torch.autograd.grad(want, [hidden, weight, bias],
                                 torch.full_like(want, upstream))
    tol = TOL[dtype]
    assert_same_ieee(got, want, tol, "loss")
    for name, a, b in zip(("hidden", "weight", "bias"), g_got, g_want):
        assert_same_ieee(a, b, tol, f"d{name}")


# -- gradients ------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "opts",
    [{}, {"softcap": 2.0, "label_smoothing": 0.1, "z_loss": 1e-2}],
    ids=["plain", "softcap+smoothing+z_loss"],
)
def test_gradcheck(case, reduction, opts):
    case.require(torch.float64)
    hidden, weight, labels, bias = make(case, (5,), 3, 37, dtype=torch.float64, bias=True)
    labels[1] = -100

    def fn(h, w, b):
        return case.loss(h, w, labels, bias=b, reduction=reduction, **opts)

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias), eps=1e-6, atol=1e-7)


class AllocSpy(TorchDispatchMode):
    """Records every floating tensor an op creates, as ``numels`` (a set) and ``created``
    (``(shape, bytes)`` in order). Views and in-place results share an input's storage and are
    not creations."""

    def __init__(self):
        super().__init__()
        self.numels = set()
        self.created = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.is_floating_point()
                and t.untyped_storage().data_ptr() not in ins
            ):
                self.numels.add(t.numel())
                self.created.append((tuple(t.shape), t.numel() * t.element_size()))
        return out


MODES = {
    "grad": torch.enable_grad,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("rg", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["FF", "TF", "FT", "TT"])  # fmt: skip
def test_requires_grad_combinations(case, oracle, rg, reduction, mode):
    """Grads exactly where asked for; and no gradient-sized buffer is ever created for an
    input that does not get a gradient (spied on at the dispatcher)."""
    # sizes chosen so N*H, V*H and every chunk-sized product are distinct numbers
    lead, h, v = (2, 5), 96, 48
    hidden, weight, labels, _ = make(case, lead, h, v, ignore_frac=0, grad=False)
    labels.view(-1)[[1, 4, 8]] = -100  # 7 of 10 rows counted: no full-size row copy either
    n = labels.numel()
    sizes = {"dH": n * h, "dW": v * h}
    assert len({*sizes.values(), 7 * h, 7 * v, n * v}) == 5
    hidden.requires_grad_(rg[0])
    weight.requires_grad_(rg[1])
    ref = oracle.loss(hidden, weight, labels, reduction=reduction)

    spy = AllocSpy()
    with MODES[mode](), spy:
        out = case.loss(hidden, weight, labels, reduction=reduction)
        wants = mode == "grad" and any(rg)
        assert out.requires_grad == wants
        if wants:
            out.sum().backward()
    assert oracle.rel_err(out, ref) <= TOL[torch.float32]
    got = {"dH": hidden.grad, "dW": weight.grad}
    for (name, g), inp, asked in zip(got.items(), (hidden, weight), rg):
        if mode == "grad" and asked:
            want = torch.autograd.grad(ref.sum(), inp, retain_graph=True)[0]
            assert g is not None and oracle.rel_err(g, want) <= TOL[torch.float32]
            assert sizes[name] in spy.numels  # the spy sees gradient buffers when they exist
        else:
            assert g is None
            assert sizes[name] not in spy.numels, f"a {name}-sized buffer was created"


def test_weighted_sum_of_none(case, oracle):
    """reduction='none' then a per-position weighted sum (some weights exactly 0)."""
    lead, h, v = case.pick(((4, 15), 24, 307), ((2, 6), 8, 37))
    hidden, weight, labels, bias = make(case, lead, h, v, bias=True)
    w = torch.rand(lead, dtype=torch.float64, device=case.device) * 3 - 1
    w[torch.rand(lead, device=case.device) < 0.3] = 0.0
    w.view(-1)[0] = 0.0

    ours = (case.loss(hidden, weight, labels, bias=bias, reduction="none") * w).sum()
    ref = (oracle.loss(hidden, weight, labels, bias=bias, reduction="none") * w).sum()
    assert oracle.rel_err(ours, ref) <= TOL[torch.float32]
    g_ours = torch.autograd.grad(ours, [hidden, weight, bias])
    g_ref = torch.autograd.grad(ref, [hidden, weight, bias])
    for a, b in zip(g_ours, g_ref):
        assert oracle.rel_err(a, b) <= TOL[torch.float32]
    zero_rows = (w == 0) | (labels == -100)
    assert (g_ours[0][zero_rows] == 0).all()


def test_retain_graph_backward_twice(case):
    """A retained graph can be differentiated again, with the same result."""
    lead, h, v = case.pick(((9,), 16, 101), ((5,), 8, 17))
    hidden, weight, labels, _ = make(case, lead, h, v)
    for reduction in REDUCTIONS:
        out = case.loss(hidden, weight, labels, reduction=reduction).sum()
        first = torch.autograd.grad(out, [hidden, weight], retain_graph=True)
        second = torch.autograd.grad(out * 2.0, [hidden, weight])
        for a, b in zip(first, second):
            assert torch.equal(2 * a, b)


def test_noncontiguous_hidden(case, oracle):
    """``hidden[:, -k:, :]`` of a transposed buffer cannot be viewed as ``[N, H]``."""
    t, b, h, v = case.pick((11, 3, 16, 101), (5, 2, 8, 17))
    base = torch.randn(t, b, h, dtype=torch.float64, device=case.device).float()
    hidden = base.transpose(0, 1)[:, 2:, :].detach().requires_grad_()
    assert not hidden.is_contiguous()
    weight = (torch.randn(v, h, device=case.device) / math.sqrt(h)).requires_grad_()
    labels = torch.randint(0, v, hidden.shape[:-1], device=case.device)
    labels[0, 0] = -100
    for reduction in REDUCTIONS:
        check_against_oracle(case, oracle, hidden, weight, labels, reduction=reduction)


# -- low precision and autocast -------------------------------------------------------------


def _peaked(case, lead, h, v, dtype):
    """Inputs whose every row has p(target) ~= 0.999 (computed in float64, then cast).

    Each row moves along a direction ``u`` near a random class's weight row; its label is the
    class that ``u`` favours most, by a clear margin, so ``z_y - logsumexp(z_others)`` grows
    without bound along ``u`` and a bisection finds the step where it equals ``log(999)``.
    """
    hidden, weight, labels, _ = make(case, lead, h, v, dtype=torch.float64, ignore_frac=0.1,
                                     grad=False)  # fmt: skip
    u = torch.empty_like(hidden)
    redo = torch.ones(lead, dtype=torch.bool, device=hidden.device)
    while redo.any():  # a near tie would need a huge step (and overflow float16)
        pick = torch.randint(0, v, lead, device=hidden.device)
        fresh = weight[pick] + 0.3 * torch.randn_like(hidden) / math.sqrt(h)
        u = torch.where(redo.unsqueeze(-1), fresh, u)
        top2 = (u @ weight.t()).topk(2, dim=-1).values
        redo = top2[..., 0] - top2[..., 1] < 0.1
    y = (u @ weight.t()).argmax(-1)
    labels = torch.where(labels == -100, labels, y)
    target = math.log(999.0)

    def margin(t):
        z = (hidden + t.unsqueeze(-1) * u) @ weight.t()
        others = z.scatter(-1, y.unsqueeze(-1), -math.inf).logsumexp(-1)
        return z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - others

    lo = torch.zeros(lead, dtype=torch.float64, device=hidden.device)
    hi = torch.ones_like(lo)
    while (margin(hi) < target).any():
        hi = torch.where(margin(hi) < target, 2 * hi, hi)
    for _ in range(80):
        mid = (lo + hi) / 2
        below = margin(mid) < target
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    hidden = hidden + hi.unsqueeze(-1) * u
    p = torch.softmax(hidden @ weight.t(), -1).gather(-1, y.unsqueeze(-1))
    assert ((p - 0.999).abs() < 1e-9).all()
    return [hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), labels]


def _torch_path(hidden, weight, labels, reduction):
    """PyTorch's own path: a linear in the input dtype, then float32 cross-entropy."""
    logits = F.linear(hidden, weight).float()
    out = F.cross_entropy(logits.flatten(0, -2), labels.reshape(-1), reduction=reduction)
    return out.view(labels.shape) if reduction == "none" else out


@pytest.mark.parametrize("peaked", [False, True], ids=["random", "p0.999"])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_no_less_precise_than_torch(case, oracle, dtype, peaked):
    """Error against float64 no worse than PyTorch's own path in that dtype — also when
    p(target) ~= 0.999, where ``LSE - z_y`` and ``p_y - 1`` cancel."""
    case.require(dtype)
    lead, h, v = case.pick(((3, 21), 64, 1009), ((2, 7), 16, 61))
    if peaked:
        hidden, weight, labels = _peaked(case, lead, h, v, dtype)
    else:
        hidden, weight, labels, _ = make(case, lead, h, v, dtype=dtype, logit_std=3.0)
    # Per-position losses, and the gradients of their sum. (A mean would let torch's
    # per-row rounding errors cancel, while float32's own floor for a loss of ~1e-3 — about
    # 1e-4 relative, in both — does not.)
    results = {}
    for who, fn in (("ours", case.loss), ("torch", lambda *a, **k: _torch_path(*a, "none"))):
        loss = fn(hidden, weight, labels, reduction="none")
        results[who] = (loss, *torch.autograd.grad(loss.sum(), [hidden, weight]))
    # the oracle's gradients taken at float64 leaves, so they are not rounded back to dtype
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    loss = oracle.loss(h64, w64, labels, reduction="none")
    results["ref"] = (loss, *torch.autograd.grad(loss.sum(), [h64, w64]))
    assert results["ours"][0].dtype == torch.float32
    loss_ref = results["ref"][0]
    floor = _relative_floor(loss_ref)
    for i, name in enumerate(("loss", "dH", "dW")):
        ours, theirs, ref = (results[w][i] for w in ("ours", "torch", "ref"))
        assert ours.dtype == theirs.dtype
        e_ours, e_torch = oracle.rel_err(ours, ref), oracle.rel_err(theirs, ref)
        assert e_ours <= LOWP_SLACK * e_torch + floor, (
            f"{name}: error {e_ours:.3g} vs torch's {e_torch:.3g} (floor {floor:.2g})"
        )


def _relative_floor(loss):
    """:data:`LOWP_ABS_FLOOR` per position, relative to the norm of the per-position loss
    (applied to the gradients too: their error follows the loss's, position by position)."""
    per_position = LOWP_ABS_FLOOR * loss.numel() ** 0.5 / float(loss.detach().double().norm())
    return per_position + LOWP_REL_FLOOR


def test_autocast_bf16_float32_master_weight(case, oracle):
    """Under autocast(bf16), a float32 weight gets a float32 gradient, as from lm_head."""
    case.require(torch.bfloat16)
    lead, h, v = case.pick(((2, 13), 32, 257), ((3, 11), 16, 127))
    hidden, weight, labels, bias = make(case, lead, h, v, bias=True)
    with torch.autocast(torch.device(case.device).type, dtype=torch.bfloat16):
        ours = case.loss(hidden, weight, labels, bias=bias)
        theirs = F.cross_entropy(F.linear(hidden, weight, bias).float().flatten(0, -2),
                                 labels.reshape(-1))  # fmt: skip
    assert ours.dtype == torch.float32
    # the oracle on exactly what autocast feeds the matmul (bfloat16 values held in float64
    # leaves, so its gradients are not rounded to bfloat16 on the way back)
    leaves = [t.detach().bfloat16().double().requires_grad_() for t in (hidden, weight, bias)]
    ref = oracle.loss(leaves[0], leaves[1], labels, bias=leaves[2])
    g_ours = torch.autograd.grad(ours, [hidden, weight, bias])
    g_theirs = torch.autograd.grad(theirs, [hidden, weight, bias])
    g_ref = torch.autograd.grad(ref, leaves)
    floor = LOWP_ABS_FLOOR / float(ref.detach()) + LOWP_REL_FLOOR
    for a, b, r in zip((ours, *g_ours), (theirs, *g_theirs), (ref, *g_ref)):
        assert a.dtype == torch.float32 and b.dtype == torch.float32
        assert oracle.rel_err(a, r) <= LOWP_SLACK * oracle.rel_err(b, r) + floor


# -- non-finite inputs ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_inputs_propagate(case, bad):
    lead, h, v = case.pick(((9,), 16, 101), ((5,), 8, 17))
    hidden, weight, labels, _ = make(case, lead, h, v, ignore_frac=0, grad=False)
    hidden = hidden.clone()
    hidden[2, 3] = bad  # row 2's logits: NaN, or +inf and -inf mixed
    per = case.loss(hidden, weight, labels, reduction="none")
    assert per[2].isnan(), f"a {bad} in the hidden state gave loss {float(per[2])}"
    assert torch.isfinite(per[torch.arange(len(per)) != 2]).all()
    for reduction in ("sum", "mean"):
        assert case.loss(hidden, weight, labels, reduction=reduction).isnan()
    # the same value in the weight, reached by every row with a positive coefficient
    hidden[:, 0] = hidden[:, 0].abs() + 0.5
    hidden[2, 3] = 0.0
    weight = weight.clone()
    weight[5, 0] = abs(bad)
    per = case.loss(hidden, weight, labels, reduction="none")
    assert per.isnan().all(), per


__all__ = ["Case", "TOL", "AllocSpy", "make", "check_against_oracle", "pytestmark"] + [
    name for name in list(globals()) if name.startswith("test_")
]

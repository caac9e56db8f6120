"""Schedule variants of backend ``"triton"``'s chunked path (issue 14,
:class:`~fused_ce_patch.backends.triton.chunked_path.ChunkedTuning`) under the Triton
interpreter: every variant gives the loss and gradients of the default schedule (bit for bit
where it changes only the order of independent operations; within float32 summation order or
bf16 chunk-sum rounding where it moves block or chunk boundaries) and is no further from the
float64 oracle than the default schedule. On the CPU ``overlap`` runs its double-buffered
order on one stream, which checks that no chunk's logits overwrite a buffer still in use.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA",
                allow_module_level=True)  # fmt: skip
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from interpreted import import_kernels  # noqa: E402

import_kernels()  # before anything else imports the kernels
from semantics import LOWP_SLACK, TOL, Case, make  # noqa: E402

from fused_ce_patch.backends import triton as triton_backend  # noqa: E402
from fused_ce_patch.backends.triton import chunked_path  # noqa: E402
from fused_ce_patch.backends.triton.chunked_path import (  # noqa: E402
    TUNING_ENV,
    ChunkedTuning,
    parse_tuning,
)

pytestmark = pytest.mark.usefixtures("one_thread")

#: Variants that only reorder independent operations: bitwise the default's results.
EXACT = ("overlap,rows=2", "dh_first", "programs=3")
#: Variants that move block boundaries of float32 sums (``block_v``) or chunk boundaries of
#: dW's bf16 accumulation (``rows``, ``overlap`` alone): equal within those roundings.
CLOSE = ("overlap,dh_first", "rows=0.5", "block_v=16,stages=2", "programs=2,block_v=32,warps=2",
         "sub_rows=4", "sub_rows=4,block_v=64", "sub_rows=8,block_v=64,programs=2")

#: id: (dtype, make options, loss options, reduction, which leaves need gradients, rows a chunk):
#: the eager pass (bf16 sum/mean), the stats + recompute passes (fp16, reduction "none"),
#: float32, a non-contiguous hidden (gathered chunks), a frozen weight.
CONFIGS = {
    "bf16-mean-everything": (torch.bfloat16, dict(bias=True, logit_std=8.0),
                             dict(softcap=5.0, label_smoothing=0.1, z_loss=1e-3), "mean",
                             (True, True, True), 17),
    "fp16-none": (torch.float16, {}, {}, "none", (True, True, False), 16),
    "fp32-sum-noncontig": (torch.float32, dict(bias=True), dict(label_smoothing=0.05), "sum",
                           (True, True, True), 19),
    "bf16-frozen-W": (torch.bfloat16, {}, dict(z_loss=1e-2), "mean", (True, False, False), 18),
}  # fmt: skip
#: About 78 counted rows: at least 4 chunks (16 rows is the chunked path's smallest chunk).
N, H, V = 97, 12, 211


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(TUNING_ENV, raising=False)


@functools.lru_cache(maxsize=None)
def _inputs(config: str):
    dtype, make_kw, _, _, need, _ = CONFIGS[config]
    with torch.random.fork_rng():
        torch.manual_seed(sum(map(ord, config)))
        hidden, weight, labels, bias = make(Case("triton"), (N,), H, V, dtype=dtype, grad=False,
                                            ignore_frac=0.2, **make_kw)  # fmt: skip
        if config.endswith("noncontig"):  # every second row of a wider tensor: gathered chunks
            wide = torch.zeros(2 * N, H + 3, dtype=dtype)
            wide[::2, :H] = hidden
            hidden = wide[::2, :H]
        up = torch.rand(N, dtype=torch.float64)
    for t, req in zip((hidden, weight, bias), need):
        if t is not None:
            t.requires_grad_(req)
    return hidden, weight, labels, bias, up


def _run(config: str, monkeypatch, tuning: str | None, oracle=None):
    """Loss and gradients of ``config`` with ``tuning`` in the environment (None: float64
    oracle, the ``oracle`` fixture of tests/conftest.py). Several chunks of ``rows`` rows
    each, so both overlap buffers are reused."""
    _, _, opts, reduction, _, rows = CONFIGS[config]
    hidden, weight, labels, bias, up = _inputs(config)
    leaves = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    if tuning is None:
        exact = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None
                 for t in (hidden, weight, bias)]  # fmt: skip
        out = oracle.loss(exact[0], exact[1], labels, bias=exact[2], reduction=reduction, **opts)
        leaves = [t for t in exact if t is not None and t.requires_grad]
    else:
        chunks = []
        original = chunked_path._chunks

        def counted(*args):
            for chunk in original(*args):
                chunks.append(chunk[1] - chunk[0])
                yield chunk

        monkeypatch.setattr(chunked_path, "_chunks", counted)
        monkeypatch.setenv(TUNING_ENV, tuning)
        budget = rows * V * hidden.element_size()
        out = Case("triton", logits_budget=budget).loss(hidden, weight, labels, bias=bias,
                                                        reduction=reduction, **opts)  # fmt: skip
        monkeypatch.delenv(TUNING_ENV)
        assert len(chunks) >= 4, chunks  # the chunked path, several chunks
        monkeypatch.setattr(chunked_path, "_chunks", original)
    g = up.to(out.dtype) if reduction == "none" else torch.tensor(0.7, dtype=out.dtype)
    return (out.detach(), *torch.autograd.grad(out, leaves, g))


_BASE: dict = {}


def _baseline(config, monkeypatch, oracle):
    if config not in _BASE:
        _BASE[config] = (_run(config, monkeypatch, ""), _run(config, monkeypatch, None, oracle))
    return _BASE[config]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("tuning", EXACT + CLOSE)
def test_variant_matches_default_and_oracle(monkeypatch, oracle, config, tuning):
    (base, ref), ours = _baseline(config, monkeypatch, oracle), _run(config, monkeypatch, tuning)
    dtype = CONFIGS[config][0]
    for i, (a, b, r) in enumerate(zip(ours, base, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if tuning in EXACT:
            assert torch.equal(a, b), (i, (a - b).abs().max())
        else:
            # a few float32 ulps in the loss; dW may differ by bf16 chunk-sum rounding
            tol = 1e-6 if i == 0 or dtype == torch.float32 else 2e-2
            assert oracle.rel_err(a, b) <= tol, (i, oracle.rel_err(a, b))
        e_ours, e_base = oracle.rel_err(a, r), oracle.rel_err(b, r)
        if dtype == torch.float32:
            assert e_ours <= TOL[torch.float32], (i, e_ours)
        assert e_ours <= LOWP_SLACK * e_base + 1e-6, (i, e_ours, e_base)


def test_overlap_reuses_two_buffers(monkeypatch):
    """Chunks alternate between two buffers (no allocation per chunk) and each chunk's logits
    are formed before it is handed out, the next one's before its consumer runs."""
    hidden, weight, labels, bias, _ = _inputs("bf16-frozen-W")
    valid = (labels != -100).nonzero().squeeze(1)
    cfg = chunked_path.ChunkedConfig(spec=None, reduction="sum", scale=1.0,
                                     n_valid=valid.numel(), rows=5, eager=True,
                                     need=(True, False, False),
                                     tuning=ChunkedTuning(overlap=True))  # fmt: skip
    h, w = hidden.detach(), weight.detach()
    seen = []
    for _, _, _, hc, _, _, z in chunked_path._logit_chunks(cfg, h, w, None, valid, labels[valid]):
        assert torch.equal(z, hc @ w.t())
        seen.append(z.data_ptr())
        z.fill_(float("nan"))  # the consumer overwrites its chunk; the next one must not see it
    assert len(seen) == -(-valid.numel() // 5) >= 4
    assert len(set(seen)) == 2 and seen[0::2] == [seen[0]] * len(seen[0::2])


@pytest.mark.parametrize(
    "text,want",
    [
        ("", ChunkedTuning()),
        (" overlap , dh_first=0 ", ChunkedTuning(overlap=True)),
        ("rows=2,block_v=8192,warps=16,stages=4,programs=1.5,sub_rows=16",
         ChunkedTuning(rows=2.0, block_v=8192, warps=16, stages=4, programs=1.5, sub_rows=16)),
        ("fast_math=0", ChunkedTuning(fast_math=False)),
        ("fast_math", ChunkedTuning(fast_math=True)),
    ],
)  # fmt: skip
def test_parse_tuning(text, want):
    assert parse_tuning(text) == want
    assert ChunkedTuning(overlap=True, rows=3.0).rows_factor == 1.5


BAD = ["overlap=2", "rows", "rows=x", "rows=0", "rows=inf", "rows=nan", "block_v=100", "warps=3",
       "stages=0", "programs=-1", "sub_rows=3", "fast", "fast_math=2"]  # fmt: skip


@pytest.mark.parametrize("default", [True, False])
@pytest.mark.parametrize("text", ["", "fast_math=0", "fast_math"])
def test_fast_math_can_only_be_turned_off(default, text):
    """``fast_math=0`` turns the PTX approximations off; nothing turns them on where the
    default (a device without NVIDIA's PTX) has them off."""
    from fused_ce_patch.backends.triton import launch

    base = launch.RowKernelConfig(block_v=64, num_warps=4, fast_math=default)
    cfg = parse_tuning(text).row_config(base, V)
    assert cfg.fast_math == (default and text != "fast_math=0")
    assert launch.row_kernel_config(V, torch.device("cpu")).fast_math is False


@pytest.mark.parametrize("hip", [None, "7.0"], ids=["cuda", "rocm"])
def test_fast_math_default_only_on_nvidia(monkeypatch, hip):
    """The default row kernel carries inline PTX on NVIDIA GPUs only: ROCm's device type is
    ``"cuda"`` too, and Triton's AMD backend does not raise on a PTX string (Triton 3.9 for
    gfx942: LLVM prints "could not allocate output register for constraint 'f'" and the
    compilation returns a kernel)."""
    from fused_ce_patch.backends.triton import launch

    monkeypatch.setattr(torch.version, "hip", hip)
    cfg = launch.row_kernel_config(V, torch.device("cuda", 0))  # a device object only
    assert cfg.fast_math is (hip is None)


@pytest.mark.parametrize("text", BAD)
def test_parse_tuning_rejects(text):
    with pytest.raises(ValueError, match=TUNING_ENV):
        parse_tuning(text)


def test_bad_env_is_a_clear_error(monkeypatch):
    hidden, weight, labels, _, _ = _inputs("bf16-frozen-W")
    monkeypatch.setenv(TUNING_ENV, "overlap,turbo")
    with pytest.raises(ValueError, match="unknown item 'turbo'"):
        Case("triton").loss(hidden, weight, labels)


def test_row_tuning_needs_the_cuda_launchers():
    hidden, weight, labels, _, _ = _inputs("bf16-frozen-W")

    class OtherLaunchers:  # e.g. backend "ascend"'s, which size their own blocks
        pass

    problem = _problem(hidden, weight, labels)
    with pytest.raises(ValueError, match="CUDA launchers"):
        triton_backend.run_paths(problem, 16, OtherLaunchers(), tuning=ChunkedTuning(warps=4))


def _problem(hidden, weight, labels):
    """The backend's Problem for a plain mean loss, captured from a real call."""
    seen = []
    original = triton_backend.TritonBackend.run

    def spy(self, problem):
        seen.append(problem)
        return original(self, problem)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_backend.TritonBackend, "run", spy)
        Case("triton").loss(hidden, weight, labels)
    return seen[0]


@pytest.mark.parametrize("tuning", ["block_v=8", "block_v=16,sub_rows=32", "sub_rows=64"])
def test_sub_rows_never_exceed_block_v(monkeypatch, oracle, tuning):
    """A tuned ``block_v`` below the default's ``sub_rows`` (CUDA: 16 segments once
    ``block_v >= 4096``) keeps at most ``block_v`` segments: ``block_v / sub_rows`` logits a
    segment must stay >= 1. Reproduced here with a CUDA-like default (16 segments)."""
    from fused_ce_patch.backends.triton import launch

    real = launch.row_kernel_config

    def cuda_like(vocab, device):
        return launch.RowKernelConfig(block_v=min(64, launch._pow2(vocab)), num_warps=4,
                                      num_stages=1, sub_rows=16)  # fmt: skip

    cfg = parse_tuning(tuning).row_config(cuda_like(V, torch.device("cpu")), V)
    assert 1 <= cfg.sub_rows <= cfg.block_v, cfg
    monkeypatch.setattr(launch, "row_kernel_config", cuda_like)
    config = "fp32-sum-noncontig"
    ours = _run(config, monkeypatch, tuning)
    monkeypatch.setattr(launch, "row_kernel_config", real)
    (base, ref) = _baseline(config, monkeypatch, oracle)
    for i, (a, b, r) in enumerate(zip(ours, base, ref)):
        assert oracle.rel_err(a, b) <= 1e-6, (i, oracle.rel_err(a, b))
        assert oracle.rel_err(a, r) <= TOL[torch.float32], (i, oracle.rel_err(a, r))

"""The default tile of the per-token statistics never holds more transient logits than the path
it replaces (fused_ce_patch.tile_policy), and the results stay exact (float64 oracle).

The bound is checked on what the kernel really allocates: a dispatch watcher records every
tensor created during forward and backward and tracks the bytes of the logits-like ones (2-D,
last dimension not the hidden size) that are alive at once.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fused_ce_patch import fused_linear_token_stats, tile_policy
from fused_ce_patch.backends.token_stats import DEFAULT_BUDGET as TILES_DEFAULT
from fused_ce_patch.tile_policy import TRL_CHUNKED_NLL, TRL_LOGPROB, ReplacedTiling
from test_token_stats import _inputs, _oracle

MiB = 2**20


class LogitsWatcher(TorchDispatchMode):
    """Peak bytes of live 2-D tensors whose last dimension is neither ``hidden_size`` nor 1
    (logit tiles, their temporaries and gradients; dH and dW blocks are hidden-sized, ``[R, 1]``
    columns are per-row state), and the largest single one, over everything dispatched inside
    the mode. Views of the inputs (``weight.t()``) allocate nothing and are not counted."""

    def __init__(self, hidden_size: int, inputs=()):
        super().__init__()
        self.hidden_size = hidden_size
        # views of the inputs (weight.t() is 2-D and not hidden-sized) are no new memory
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
        self.live: dict[int, list] = {}  # storage pointer -> [bytes, references]
        self.now = 0
        self.peak = 0
        self.largest = 0
        self.largest_shape = None

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def _track(self, t):
        if (not isinstance(t, torch.Tensor) or t.dim() != 2
                or t.shape[-1] in (1, self.hidden_size)):  # [R, 1]: per-row state, not logits
            return
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.inputs:
            return
        if size > self.largest:
            self.largest, self.largest_shape = size, tuple(t.shape)
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [size, 1]
            self.now += size
            self.peak = max(self.peak, self.now)
        else:
            entry[1] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            self._track(t)
        return out


def _watched_step(n, h, v, *, dtype=torch.float32, softcap=None, **kwargs):
    hid, w, b, y = _inputs(n, h, v, dtype=dtype, ignored=0.0)
    watcher = LogitsWatcher(h, (hid, w, b, y))
    with watcher:
        out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True, accuracy=True,
                                       mean_logits=True, log_sum_sq_probs=True,
                                       softcap=softcap, backend="torch", **kwargs)
        g = torch.linspace(-1.0, 1.0, n, dtype=out.log_probs.dtype)  # per-token weights
        ((out.log_probs * g).sum() + 0.1 * out.entropy.sum()).backward()
    return watcher


# -- the policy as a function ----------------------------------------------------------------


def test_tile_bytes_of_each_replaced_path():
    # TRL's head: min(N, 4096) x min(V, 32768) logits in the compute dtype
    assert TRL_LOGPROB.tile_bytes(310, 49152, torch.float32) == 310 * 32768 * 4
    assert TRL_LOGPROB.tile_bytes(10000, 128256, torch.bfloat16) == 4096 * 32768 * 2
    assert TRL_LOGPROB.tile_bytes(5, 1003, torch.float16) == 5 * 1003 * 2
    # chunked_nll: 256 rows by the whole vocabulary, always float32
    assert TRL_CHUNKED_NLL.tile_bytes(310, 49152, torch.bfloat16) == 256 * 49152 * 4
    assert TRL_CHUNKED_NLL.tile_bytes(100, 49152, torch.bfloat16) == 100 * 49152 * 4
    assert TRL_LOGPROB.tile_bytes(0, 7, torch.float32) == 7 * 4  # never 0 (0 means "no tile")


@pytest.mark.parametrize("replaced", [TRL_LOGPROB, TRL_CHUNKED_NLL,
                                      ReplacedTiling("tiny", rows=3, cols=5, itemsize=1)])
@pytest.mark.parametrize("rows", [1, 17, 162, 310, 4095, 4096, 8192, 32768, 10**6])
@pytest.mark.parametrize("vocab", [2, 1003, 32000, 49152, 262144])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_budget_never_exceeds_the_replaced_tile_or_the_default(replaced, rows, vocab, dtype):
    default = 248 * MiB
    got = tile_policy.logits_budget(rows, vocab, dtype, replaced, default)
    bound = replaced.tile_bytes(rows, vocab, dtype)
    assert 1 <= got <= min(bound, default)
    assert got == min(bound, default)  # as large as allowed: big tiles where TRL's are big


def test_large_gpu_calls_take_the_speed_policy_within_trls_tile():
    # The TRL routes use the loss's default (the speed policy), capped at the replaced tile.
    from fused_ce_patch.backends.triton import default_budget, memory_first_budget

    # Llama-3 shape in TRL (8192 counted bf16 rows): the policy's ~1 GiB chunk is capped at
    # TRL's own 256 MiB tile, so the route holds no more than TRL's head did
    d = default_budget(8192, 128256, 4096, 2)
    assert d > 256 * MiB
    got = tile_policy.logits_budget(8192, 128256, torch.bfloat16, TRL_LOGPROB, d)
    assert got == 4096 * 32768 * 2
    # a few hundred rows: the policy keeps the memory-first budget, TRL's tile caps it below
    d = default_budget(300, 49152, 576, 2)
    assert d == memory_first_budget(300)
    got = tile_policy.logits_budget(300, 49152, torch.bfloat16, TRL_LOGPROB, d)
    assert got == 300 * 32768 * 2


# -- what the kernel allocates ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("n,v", [(40, 40000), (9, 33001)])
def test_default_never_holds_more_logits_than_trls_tile(n, v, softcap, dtype):
    bound = TRL_LOGPROB.tile_bytes(n, v, dtype)
    assert n * v * dtype.itemsize > bound  # the call's whole logits would exceed TRL's tile
    watcher = _watched_step(n, 8, v, dtype=dtype, softcap=softcap)
    assert watcher.largest <= bound, (watcher.largest_shape, bound)
    assert watcher.peak <= bound, (watcher.peak, bound)


def test_the_watcher_sees_the_pre_policy_default_exceed_the_bound():
    # the loss's default (all rows, whole vocabulary in one tile) is what the policy removed
    n, v = 40, 40000
    watcher = _watched_step(n, 8, v, logits_budget=TILES_DEFAULT)
    bound = TRL_LOGPROB.tile_bytes(n, v, torch.float32)
    assert watcher.largest_shape == (n, v)
    assert watcher.peak > 2 * bound


def test_chunked_nll_tiling_bounds_the_call():
    n, v = 300, 4000  # more rows than chunked_nll's 256-row chunk
    bound = TRL_CHUNKED_NLL.tile_bytes(n, v, torch.float32)
    assert n * v * 4 > bound
    watcher = _watched_step(n, 8, v, replaces=TRL_CHUNKED_NLL)
    assert watcher.peak <= bound, (watcher.peak, bound)


def test_triton_backend_receives_the_capped_budget(monkeypatch):
    # backend "triton" reads the budget as bytes of one logits chunk; spy what it is given
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    import fused_ce_patch.backends.triton.token_stats as triton_stats

    seen = []

    def spy(hidden, weight, bias, labels, transform, extras, budget, hint=None):
        seen.append(budget)
        return None  # the caller falls back to the torch tiles (no interpreted kernel run)

    monkeypatch.setattr(triton_stats, "token_stats_triton", spy)
    hid, w, b, y = _inputs(50, 8, 40000, dtype=torch.float32, ignored=0.2)
    fused_linear_token_stats(hid, w, y, bias=b, backend="triton")
    m = int((y != -100).sum())
    assert seen == [m * 32768 * 4]
    replaced = ReplacedTiling("test", rows=16, cols=1000)
    fused_linear_token_stats(hid, w, y, bias=b, backend="triton", replaces=replaced)
    assert seen[-1] == 16 * 1000 * 4
    fused_linear_token_stats(hid, w, y, bias=b, backend="triton", logits_budget=12345)
    assert seen[-1] == 12345  # an explicit budget is the caller's


# -- exactness unchanged ---------------------------------------------------------------------


@pytest.mark.parametrize("replaces", [None, TRL_CHUNKED_NLL,
                                      ReplacedTiling("odd", rows=5, cols=7)])
def test_policy_tiles_exact_against_float64(replaces):
    # float64: several vocabulary blocks and row tiles of odd sizes under every policy
    hid, w, b, y = _inputs(37, 11, 1001)
    out = fused_linear_token_stats(hid, w, y, bias=b, entropy=True, accuracy=True,
                                   backend="torch", replaces=replaces)
    lp, ent, top1 = _oracle(hid, w, b, y)
    torch.testing.assert_close(out.log_probs, lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.entropy, ent, rtol=1e-12, atol=1e-12)
    assert torch.equal(out.is_top1, top1)
    g = torch.randn(37, dtype=torch.float64)
    got = torch.autograd.grad((out.log_probs * g).sum() + out.entropy.sum(), (hid, w, b))
    want = torch.autograd.grad((lp * g).sum() + ent.sum(), (hid, w, b))
    for a, r in zip(got, want):
        assert ((a - r).norm() / r.norm()).item() < 1e-12


def test_replaces_must_be_a_replaced_tiling():
    hid, w, b, y = _inputs(4, 3, 5)
    with pytest.raises(TypeError, match="replaces"):
        fused_linear_token_stats(hid, w, y, replaces=(256, None))

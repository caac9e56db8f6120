"""The default budget of backend ``"triton"`` (the speed policy,
``fused_ce_patch.backends.triton.default_budget``): the chunk it picks per shape, the memory
caps it honours, and the memory-first settings, which stay what they were.

The policy is arithmetic on the host: the shape tests need no kernel. The chunk a call really
runs is checked by spying on the chunked path's rows, under the Triton interpreter, with the
cap scaled down so that small shapes take several chunks; the loss stays exact (float64 oracle).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from fused_ce_patch.backends import triton as tb

MiB = 2**20
GiB = 2**30

#: name: (tokens, H, V); 10 % of the labels ignored, as in benchmarks/gpu_bench.py
SHAPES = {
    "llama3-8b": (8192, 4096, 128256),
    "gemma2-2b": (8192, 2304, 256000),
    "qwen2.5-7b": (8192, 3584, 152064),
    "llama2-7b": (8192, 4096, 32000),
    "llama3-8b-long": (32768, 4096, 128256),
    "gemma3-270m": (32768, 640, 262144),
}


def _counted(tokens: int) -> int:
    return tokens - tokens // 10


@pytest.mark.parametrize("name", list(SHAPES))
def test_policy_bounds_at_the_benchmark_shapes(name):
    tokens, h, v = SHAPES[name]
    m = _counted(tokens)
    got = tb.default_budget(m, v, h, 2)
    all_rows = m * tb.chunk_row_bytes(v, h, 2)
    # never below the memory-first budget, which was the default before the policy
    assert got >= tb.memory_first_budget(m)
    if got > tb.memory_first_budget(m):
        # above it: within the cap and within half of the counted rows (rounded up)
        half = math.ceil(m / 2) * tb.chunk_row_bytes(v, h, 2)
        assert got <= tb.SPEED_CAP
        assert got <= half <= all_rows // 2 + tb.chunk_row_bytes(v, h, 2)
        # as large as those two allow
        assert got == min(tb.SPEED_CAP, half)


# Chunks per call at the benchmark shapes (bf16, 10 % ignored), by the policy and by the
# memory-first budget (counted by hand: counted rows / (budget // bytes a row)).
@pytest.mark.parametrize("name,policy_chunks,memory_first_chunks", [
    ("llama3-8b", 2, 8),       # half the rows: 988 MiB
    ("gemma2-2b", 4, 15),      # the 992 MiB cap
    ("qwen2.5-7b", 3, 10),
    ("llama2-7b", 2, 3),       # half the rows: 311 MiB (CCE's torch_compile keeps 443 MiB)
    ("llama3-8b-long", 8, 16),
    ("gemma3-270m", 15, 30),
])
def test_chunks_per_shape(name, policy_chunks, memory_first_chunks):
    tokens, h, v = SHAPES[name]
    m = _counted(tokens)
    per_row = tb.chunk_row_bytes(v, h, 2)
    policy = math.ceil(m / (tb.default_budget(m, v, h, 2) // per_row))
    first = math.ceil(m / (tb.memory_first_budget(m) // per_row))
    assert (policy, first) == (policy_chunks, memory_first_chunks)


@pytest.mark.parametrize("memory_gib,cap_mib", [(141, 992), (80, 992), (40, 640), (24, 384)])
def test_device_memory_scales_the_cap(monkeypatch, memory_gib, cap_mib):
    monkeypatch.setattr(tb, "_device_memory", lambda index: memory_gib * GiB)
    m, h, v = _counted(32768), 4096, 128256  # all rows: 7.2 GiB, far above any cap
    got = tb.default_budget(m, v, h, 2, torch.device("cuda", 0))
    assert got == max(tb.memory_first_budget(m), cap_mib * MiB)
    # a CPU tensor (the interpreter) knows no device memory: the plain cap
    assert tb.default_budget(m, v, h, 2, torch.device("cpu")) == tb.SPEED_CAP


def test_small_calls_keep_the_memory_first_budget():
    # a few hundred rows: half of them is far below the memory-first budget, which holds all
    for m, h, v in ((1, 64, 1000), (300, 2048, 128256), (900, 640, 262144)):
        assert tb.default_budget(m, v, h, 2) == tb.memory_first_budget(m)


def test_memory_first_budget_is_the_former_default():
    # DEFAULT_BUDGET stays the memory-first constant: logits_budget=DEFAULT_BUDGET is the
    # documented memory-first setting, and the earlier default rule per counted rows
    assert tb.DEFAULT_BUDGET == tb.MEMORY_FIRST_BUDGET == 248 * MiB
    assert tb.memory_first_budget(100) == 248 * MiB
    assert tb.memory_first_budget(8192) == 248 * MiB
    assert tb.memory_first_budget(12288) == 372 * MiB
    assert tb.memory_first_budget(10**6) == 496 * MiB


# -- the budget a call runs with (interpreter) -----------------------------------------------

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="interpreter tests run on CPU-only machines with triton installed")


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from interpreted import import_kernels

    import_kernels()
    from fused_ce_patch.backends.triton import chunked_path

    rows_seen = []
    original = chunked_path.plan_rows

    def spy(n_valid, rows_max):
        rows = original(n_valid, rows_max)
        rows_seen.append(rows)
        return rows

    monkeypatch.setattr(chunked_path, "plan_rows", spy)
    return rows_seen


def _inputs(n, h, v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::10] = -100
    return hidden, weight, labels


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_call_runs_the_policy_chunks_exactly(kernels, monkeypatch, oracle, dtype):
    from fused_ce_patch import fused_linear_cross_entropy

    n, h, v = 90, 12, 331
    hidden, weight, labels = _inputs(n, h, v, dtype, seed=7)
    m = int((labels != -100).sum())
    per_row = tb.chunk_row_bytes(v, h, hidden.element_size())
    # scale the policy down to this shape: memory-first holds 16 rows, the cap 40
    monkeypatch.setattr(tb, "MEMORY_FIRST_BUDGET", 16 * per_row * 8192 // max(m, 8192))
    monkeypatch.setattr(tb, "SPEED_CAP", 40 * per_row)
    budget = tb.default_budget(m, v, h, hidden.element_size(), hidden.device)
    assert m == 81 and budget == 40 * per_row  # the cap (half of the counted rows is 41)
    loss = fused_linear_cross_entropy(hidden, weight, labels, backend="triton")
    assert kernels == [27]  # three chunks of 27 rows: at most 40 a chunk, of equal size
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = oracle.loss(h64, w64, labels)
    rh, rw = torch.autograd.grad(ref, (h64, w64))
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # float32 sums; one bf16 rounding of dH/dW
    assert oracle.rel_err(loss, ref) < (1e-6 if dtype == torch.float32 else 1e-3)
    assert oracle.rel_err(dh, rh) < tol
    assert oracle.rel_err(dw, rw) < tol


@needs_interpreter
def test_explicit_budgets_are_the_callers(kernels, monkeypatch):
    from fused_ce_patch import fused_linear_cross_entropy

    n, h, v = 64, 8, 97
    hidden, weight, labels = _inputs(n, h, v, torch.float32, seed=3)
    m = int((labels != -100).sum())
    assert m == 57
    # an explicit budget counts the logits only, whatever the policy says
    monkeypatch.setattr(tb, "SPEED_CAP", 10**12)
    fused_linear_cross_entropy(hidden, weight, labels, backend="triton",
                               logits_budget=20 * v * 4)
    assert kernels == [19]  # at most 20 rows of float32 logits: three chunks of 19
    # the memory-first setting is one argument away and chunks as the old default did
    fused_linear_cross_entropy(hidden, weight, labels, backend="triton",
                               logits_budget=tb.MEMORY_FIRST_BUDGET)
    assert kernels[-1] == m  # 248 MiB of logits hold every row of this call

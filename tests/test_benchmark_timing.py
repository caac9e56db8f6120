"""benchmarks/timing.py (the timer of every benchmark) and the CPU runs of cpu_torch_lce.py and
gpu_compile_ab.py."""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name):
    """Import a benchmark script as its siblings do (benchmarks/ on the path)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


timing = _load("timing")


def test_counts_calls_and_resets():
    calls, resets = [], []
    out = timing.time_ms(lambda: calls.append(len(resets)), iters=3, warmup=2,
                         reset=lambda: resets.append(1))  # fmt: skip
    assert len(calls) == 5 and len(resets) == 5
    assert calls == [0, 1, 2, 3, 4]  # reset runs after every call, before the next
    assert len(out.ms) == 3 and len(out.cpu_ms) == 3 and out.peak_bytes is None


def test_measures_wall_and_cpu_time():
    out = timing.time_ms(lambda: time.sleep(0.03), iters=3)
    assert all(25.0 <= ms < 1000.0 for ms in out.ms), out.ms
    assert out.min <= out.median <= out.max
    # sleeping costs wall time, not CPU time
    assert out.median > 5 * max(statistics.median(out.cpu_ms), 1e-3)


def test_median_of_known_times():
    t = timing.Timing(ms=[5.0, 1.0, 3.0, 100.0, 2.0])
    assert (t.median, t.min, t.max) == (3.0, 1.0, 100.0)


@pytest.mark.parametrize("kwargs", [dict(iters=0), dict(iters=1.5), dict(iters=2, warmup=-1)])
def test_bad_counts_raise(kwargs):
    with pytest.raises(ValueError, match="iters|warmup"):
        timing.time_ms(lambda: None, **kwargs)


def test_laps_add_up_by_name():
    laps = timing.Laps("cpu")
    laps.start()
    time.sleep(0.01)
    laps.lap("a")
    time.sleep(0.02)
    laps.lap("b")
    time.sleep(0.01)
    laps.lap("a")
    out = laps.totals()
    assert set(out) == {"a", "b"}
    assert out["a"] >= 15.0 and out["b"] >= 15.0


def test_cpu_torch_lce_quick(tmp_path):
    if not hasattr(torch.nn.functional, "linear_cross_entropy"):
        pytest.skip("torch < 2.13 has no F.linear_cross_entropy")
    bench = _load("cpu_torch_lce")
    sys.path.insert(0, str(BENCH))  # the plot's plot_style import
    try:
        rows = bench.main(["--quick", "--dtypes", "float32", "--repeat", "1",
                           "--out", str(tmp_path)])  # fmt: skip
    finally:
        sys.path.remove(str(BENCH))
    assert [r["impl"] for r in rows] == ["naive", "torch-lce", "torch"]
    for r in rows:
        assert "error" not in r, r
        assert r["loss_err"] < 1e-5 and r["dh_err"] < 1e-4 and r["dw_err"] < 1e-4, r
        assert r["peak_extra_bytes"] > 0 and r["ms"] > 0
    # same inputs, same loss (float32 sums in different orders)
    assert max(r["loss"] for r in rows) - min(r["loss"] for r in rows) < 1e-4
    assert (tmp_path / "cpu_torch_lce_quick.json").is_file()
    assert (tmp_path / "cpu_torch_lce_quick.png").is_file()


@pytest.mark.slow
def test_gpu_compile_ab_tiny(tmp_path):
    """The interleaved stock / fused harness runs on the CPU: both modes, all three arms (with
    ``--stock-sync``), the ratio per block pair, Dynamo's graph breaks counted (none), each arm
    traced, its JSON written."""
    bench = _load("gpu_compile_ab")
    rows = bench.main(["--tiny", "--trace", "--stock-sync", "--out", str(tmp_path)])
    assert [r["mode"] for r in rows] == ["compiled", "eager"]
    for r in rows:
        assert len(r["stock_blocks"]) == len(r["fused_blocks"]) == 2
        assert len(r["stock_sync_blocks"]) == 2 and r["stock_sync_ratio_median"] > 0
        assert r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"]
        assert r["stock_ms"] > 0 and r["fused_ms"] > 0
        assert r["stock_graph_breaks"] == r["fused_graph_breaks"] == 0
        assert r["stock_peak_gib"] is None  # peaks are read on a GPU only
        for arm in ("stock", "fused", "stock_sync"):
            t = r["trace"][arm]
            assert t["step_ms"] > 0 and t["busy_ms"] == 0.0 and t["gaps"] == []  # no kernels
            assert abs(t["idle_ms"] - t["step_ms"]) < 1e-9
    assert (tmp_path / "gpu_compile_ab_smollm2-135m_1x32.json").is_file()

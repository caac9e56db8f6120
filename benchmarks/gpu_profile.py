"""Where the default chunked path's time goes, kernel by kernel, and how close its row kernel
runs to the device's copy bandwidth (issue 14).

Questions: (1) which kernels make up the ~2-3 ms that the per-stage timing of
``gpu_overlap.py`` leaves outside the logits / row kernel / dW / dH stages? (2) at what
bandwidth does the row kernel (``logits_grad_inplace_kernel``) stream one chunk in each of its
modes (LSE only, gradient only, both), against a device-to-device copy of the same bytes, in
each launch of ``--row-configs`` (``ChunkedTuning`` items)? (3) how long does the device sit
idle in a step, and where (``--gaps``: one traced step; ``--timeline``: untraced steps split
by CUDA events into the prelude before the first logits matmul, the rest of the forward, and
the backward, with host times)?

Method: ``gpu_bench.make_inputs`` (bf16, 10 % of labels ignored, mean reduction), backend
``"triton"`` at its default budget. (1) ``torch.profiler`` over ``--iters`` fwd+bwd after two
warm-up runs; kernels grouped by name, CUDA time per fwd+bwd. (2) one chunk of the shape's
default rows, CUDA-event medians of ``--iters`` launches per mode, bytes counted as the
kernel's reads and writes of the chunk (LSE: one read; gradient: one read and one write;
both: two reads and one write), plus ``torch`` copy ``dst.copy_(src)`` of the chunk (one
read, one write). With ``--ncu NAME`` the script re-runs itself under Nsight Compute
(``--clock-control none``) on the row kernel's first eager launch of shape NAME and writes
the report's text to ``ncu_<NAME>.txt`` under ``--out``.

Writes ``gpu_profile.json`` under ``--out`` and prints tables. ``--tiny``: CPU dry run under the
Triton interpreter (small shapes; the profiler table then lists CPU ops).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_bench  # noqa: E402  (inputs, environment)
from timing import time_ms  # noqa: E402  (the timer of every benchmark)

SHAPES = "llama3-8b,gemma3-270m,gemma2-2b"
#: Row kernel launches timed (``name=<ChunkedTuning items>``, ``;``-separated); the first is
#: the default launch.
ROW_CONFIGS = ("default=;sub1=sub_rows=1;sub8=sub_rows=8;sub8-bv2048=sub_rows=8,block_v=2048;"
               "sub16-16w=sub_rows=16,warps=16;bv8192-16w=block_v=8192,warps=16;"
               "stages2=stages=2;stages4=stages=4")  # fmt: skip
NCU_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "WarpStateStats",
                "LaunchStats", "SchedulerStats")  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--row-configs", default=ROW_CONFIGS)
    p.add_argument("--no-kernels", action="store_true", help="skip the profiler tables")
    p.add_argument("--gaps", default="", help="shapes whose idle GPU time is traced")
    p.add_argument("--timeline", default="", help="shapes whose steps are split by events")
    p.add_argument("--ncu", default="", help="shape whose row kernel Nsight Compute profiles")
    p.add_argument("--ncu-child", default="", help=argparse.SUPPRESS)
    p.add_argument("--logits-budget", type=int, default=None,
                   help="bytes of logits a step may hold (0: the zero-logits path); "
                        "default: the backend's")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    global LOGITS_BUDGET
    LOGITS_BUDGET = args.logits_budget
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    dev = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    shapes = gpu_bench.TINY if args.tiny else gpu_bench.SHAPES
    if args.ncu_child:
        one_step(torch, shapes[args.ncu_child], dev)
        return
    os.makedirs(args.out, exist_ok=True)
    out = {"env": gpu_bench.environment(torch, dev), "kernels": {}, "row_kernel": {}}
    names = list(shapes) if args.tiny else [s for s in args.shapes.split(",") if s]
    for name in names:
        if name in args.timeline.split(","):
            out.setdefault("timeline", {})[name] = timeline(torch, shapes[name], dev, args.iters)
            print(f"{name} timeline (median ms): {out['timeline'][name]}")
        if name in args.gaps.split(","):
            out.setdefault("gaps", {})[name] = idle_gaps(torch, shapes[name], dev)
            print_gaps(name, out["gaps"][name])
        if not args.no_kernels:
            out["kernels"][name] = kernel_table(torch, shapes[name], dev, args.iters)
            print_kernels(name, out["kernels"][name])
        out["row_kernel"][name] = {}
        for item in (t for t in args.row_configs.split(";") if t):
            label, _, tuning = item.partition("=")
            r = row_kernel_bandwidth(torch, shapes[name], dev, args.iters, tuning)
            out["row_kernel"][name][label] = r
            print_row_kernel(f"{name} {label}", r)
    if args.ncu:
        out["ncu"] = run_ncu(args, shapes)
    with open(os.path.join(args.out, "gpu_profile.json"), "w") as f:
        json.dump(out, f, indent=1)


#: ``--logits-budget``: passed to the loss as ``logits_budget`` (None: the backend's default).
LOGITS_BUDGET = None


def _loss(torch, data, softcap):
    from fused_ce_patch import fused_linear_cross_entropy

    h = data["hidden"].requires_grad_()
    w = data["weight"].requires_grad_()
    loss = fused_linear_cross_entropy(h, w, data["labels"], softcap=softcap, backend="triton",
                                      logits_budget=LOGITS_BUDGET)
    loss.backward()
    h.grad = w.grad = None


def one_step(torch, shape, dev):
    n, h, v, softcap = shape
    data = gpu_bench.make_inputs(torch, n, h, v, dev)
    _loss(torch, data, softcap)
    gpu_bench.sync(torch, dev)


def kernel_table(torch, shape, dev, iters):
    """``[(name, calls per step, ms per step)]``, most time first, and the step's total."""
    from torch.profiler import ProfilerActivity, profile

    n, h, v, softcap = shape
    data = gpu_bench.make_inputs(torch, n, h, v, dev)
    for _ in range(2):
        _loss(torch, data, softcap)
    gpu_bench.sync(torch, dev)
    # the same steps timed with events: what the kernels leave idle (host work, syncs)
    event_ms = _events(torch, dev, lambda: _loss(torch, data, softcap), iters)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            _loss(torch, data, softcap)
        gpu_bench.sync(torch, dev)
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if dev == "cuda" else e.self_cpu_time_total
        if us > 0 and (dev != "cuda" or e.device_type.name == "CUDA"):
            rows.append((e.key, e.count / iters, us / 1e3 / iters))
    rows.sort(key=lambda r: -r[2])
    del data
    gpu_bench.cleanup(torch, dev)
    return {"rows": rows, "total_ms": sum(r[2] for r in rows), "event_ms": event_ms}


def idle_gaps(torch, shape, dev, min_us=20.0):
    """One traced fwd+bwd: the intervals with no kernel running (longer than ``min_us``), each
    with the kernels around it and the host ops that overlap it (longest first)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    n, h, v, softcap = shape
    data = gpu_bench.make_inputs(torch, n, h, v, dev)
    for _ in range(2):
        _loss(torch, data, softcap)
    gpu_bench.sync(torch, dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        _loss(torch, data, softcap)
        gpu_bench.sync(torch, dev)
    events = prof.events()
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                 if e.device_type == DeviceType.CUDA)  # fmt: skip
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == DeviceType.CPU]  # fmt: skip
    if not gpu:
        return {"gaps": [], "step_us": 0.0}
    t0 = min(s for s, _, _ in host) if host else gpu[0][0]
    gaps = [(t0, gpu[0][0], "(step start)", gpu[0][2])]
    busy_until, last = gpu[0][1], gpu[0][2]
    for s, e, name in gpu[1:]:
        if s - busy_until > min_us:
            gaps.append((busy_until, s, last, name))
        if e > busy_until:
            busy_until, last = e, name
    rows = []
    for s, e, before, after in gaps:
        if e - s <= min_us:
            continue
        over = sorted(((min(he, e) - max(hs, s), hn) for hs, he, hn in host if hs < e and he > s),
                      reverse=True)[:6]  # fmt: skip
        rows.append({"us": e - s, "at_us": s - t0, "before": before[:60], "after": after[:60],
                     "host": [f"{hn[:50]} {d:.0f}us" for d, hn in over]})  # fmt: skip
    del data
    gpu_bench.cleanup(torch, dev)
    return {"gaps": rows, "idle_us": sum(r["us"] for r in rows),
            "step_us": busy_until - t0}  # fmt: skip


def timeline(torch, shape, dev, iters):
    """Event- and host-timed parts of untraced steps (median ms): forward up to the first
    logits matmul (validation, row selection, gathers: ``prelude``), the rest of the forward,
    the backward; host time of forward and backward; cudaMalloc / cudaFree calls per step."""
    from fused_ce_patch import fused_linear_cross_entropy
    from fused_ce_patch.backends.triton import chunked_path

    if dev != "cuda":
        return {}
    n, h, v, softcap = shape
    data = gpu_bench.make_inputs(torch, n, h, v, dev)
    hid = data["hidden"].requires_grad_()
    w = data["weight"].requires_grad_()
    marks = []
    orig = chunked_path._logits

    def marked(*a):
        if not marks:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append(ev)
        return orig(*a)

    chunked_path._logits = marked
    import time

    rows = []
    try:
        for i in range(iters + 2):
            marks.clear()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            stats0 = torch.cuda.memory_stats()
            ev[0].record()
            t0 = time.perf_counter()
            loss = fused_linear_cross_entropy(hid, w, data["labels"], softcap=softcap,
                                              backend="triton")  # fmt: skip
            t1 = time.perf_counter()
            ev[1].record()
            loss.backward()
            t2 = time.perf_counter()
            ev[2].record()
            ev[2].synchronize()
            stats1 = torch.cuda.memory_stats()
            hid.grad = w.grad = None
            if i < 2:
                continue
            rows.append({
                "prelude": ev[0].elapsed_time(marks[0]) if marks else float("nan"),
                "fwd_rest": marks[0].elapsed_time(ev[1]) if marks else float("nan"),
                "bwd": ev[1].elapsed_time(ev[2]),
                "host_fwd": (t1 - t0) * 1e3,
                "host_bwd": (t2 - t1) * 1e3,
                "mallocs": stats1.get("num_device_alloc", 0) - stats0.get("num_device_alloc", 0),
                "frees": stats1.get("num_device_free", 0) - stats0.get("num_device_free", 0),
            })  # fmt: skip
    finally:
        chunked_path._logits = orig
    del data
    gpu_bench.cleanup(torch, dev)
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}


def print_gaps(name, g):
    idle, step = g.get("idle_us", 0) / 1e3, g["step_us"] / 1e3
    print(f"\n{name}: idle GPU {idle:.2f} ms of a {step:.2f} ms traced step")
    for r in sorted(g["gaps"], key=lambda r: -r["us"])[:12]:
        print(f"  {r['us']:8.0f} us at {r['at_us'] / 1e3:7.2f} ms  {r['before']} -> {r['after']}")
        print(f"           host: {'; '.join(r['host'])}")


def print_kernels(name, t):
    print(f"\n{name}: kernels per fwd+bwd (total {t['total_ms']:.2f} ms; event-timed step "
          f"{t['event_ms']:.2f} ms)")
    for key, calls, ms in t["rows"][:30]:
        print(f"  {ms:8.3f} ms  {calls:6.1f} x  {key[:110]}")


def _events(torch, dev, fn, iters):
    """Median CUDA-event time (ms) of ``fn`` after one warm-up call; NaN off CUDA."""
    if dev != "cuda":
        fn()
        return float("nan")
    return time_ms(fn, iters=iters, warmup=1, device=dev).median


def row_kernel_bandwidth(torch, shape, dev, iters, tuning=""):
    """The row kernel on one chunk of the default path's size (launched as ``tuning``, a
    ``ChunkedTuning`` text), per mode: ms and GB/s of its bytes."""
    from fused_ce_patch.backends.base import LossSpec
    from fused_ce_patch.backends.triton import chunk_row_bytes, default_budget
    from fused_ce_patch.backends.triton.chunked_path import parse_tuning, plan_rows
    from fused_ce_patch.backends.triton.launch import TunedRowLaunchers

    n, h, v, softcap = shape
    n_valid = int(n * 0.9)
    per_row = chunk_row_bytes(v, h, 2)
    rows = plan_rows(n_valid, max(1, default_budget(n_valid, v, h, 2, dev) // per_row))
    launchers = TunedRowLaunchers(parse_tuning(tuning))
    g = torch.Generator(device=dev).manual_seed(1)
    src = (torch.randn(rows, v, device=dev, generator=g) * 2).bfloat16()
    z = src.clone()
    y = torch.randint(0, v, (rows,), device=dev, generator=g)
    lse, nll, loss, coef = (torch.empty(rows, device=dev) for _ in range(4))
    spec = LossSpec(softcap=softcap)
    nbytes = src.numel() * src.element_size()

    def mode(compute_lse, write_grad):
        def fn():  # repeated launches stream over earlier outputs: the same bytes
            launchers.logits_grad(z, y, lse, nll, loss, coef, 1.0, spec,
                                  compute_lse=compute_lse, write_grad=write_grad)  # fmt: skip

        return fn

    out = {"rows": rows, "chunk_MiB": nbytes / 2**20, "tuning": tuning}
    for key, fn, passes in (
        ("lse", mode(True, False), 1),
        ("grad", mode(False, True), 2),
        ("lse+grad", mode(True, True), 3),
        ("copy", lambda: z.copy_(src), 2),
    ):
        ms = _events(torch, dev, fn, iters)
        out[key] = {"ms": ms, "GB/s": passes * nbytes / ms / 1e6}
    del src, z
    gpu_bench.cleanup(torch, dev)
    return out


def print_row_kernel(name, r):
    cells = ", ".join(f"{k} {r[k]['ms']:.3f} ms = {r[k]['GB/s']:.0f} GB/s"
                      for k in ("lse", "grad", "lse+grad", "copy"))  # fmt: skip
    print(f"{name}: row kernel on one chunk ({r['rows']} rows, {r['chunk_MiB']:.0f} MiB): {cells}")


def run_ncu(args, shapes):
    ncu = shutil.which("ncu") or next(
        (p for p in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu")
         if os.path.exists(p)), None)  # fmt: skip
    if ncu is None:
        print("ncu: not found")
        return {"error": "ncu not found"}
    cmd = [ncu, "--clock-control", "none", "--kernel-name", "regex:logits_grad",
           "--launch-count", "1"]  # fmt: skip
    for s in NCU_SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, os.path.abspath(__file__), "--ncu-child", args.ncu]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    text = res.stdout + res.stderr
    with open(os.path.join(args.out, f"ncu_{args.ncu}.txt"), "w") as f:
        f.write(text)
    print(f"\nncu on {args.ncu} (exit {res.returncode}):\n{text[-6000:]}")
    return {"shape": args.ncu, "exit": res.returncode}


if __name__ == "__main__":
    main()

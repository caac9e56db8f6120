"""CPU benchmark: PyTorch 2.13's ``F.linear_cross_entropy`` beside ours and the stock loss.

Question: a user on torch >= 2.13 can call ``torch.nn.functional.linear_cross_entropy``
instead of this plugin. On CPU, for forward+backward (grads of hidden and weight) of a
causal-LM head, what do they cost in time and peak memory, and how far is each from a
float64 reference?

    naive      F.cross_entropy(F.linear(hidden, weight).float(), labels)  (HF's stock head)
    torch-lce  F.linear_cross_entropy(hidden, weight, labels,
                   options=torch.nn.LinearCrossEntropyOptions())  (chunked; with the
                   default ``options=None`` it is the materialising reference path)
    torch-lce-1024  the same with ``LinearCrossEntropyOptions(batch_chunk_size=1024)``
                   (its automatic chunks are 16-32 rows on CPU at these shapes)
    torch      fused_linear_cross_entropy(hidden, weight, labels)  (ours; backend "auto",
               which is the chunked torch backend on CPU)

Inputs: hidden ``[N, H]`` ~ N(0, 1), weight ``[V, H]`` ~ N(0, 1/H) (logits of unit scale),
both in ``--dtypes`` (float32 / bfloat16) and requiring grad; labels ``[N]`` int64 with every
10th position ``-100`` (ignored); mean reduction.

Each (shape, dtype, implementation) runs in a fresh subprocess (as ``cpu_chunked.py``): one
warm-up forward+backward, grads dropped, the kernel's peak-RSS mark reset
(``/proc/self/clear_refs``), baseline ``VmRSS`` read, then ``--repeat`` timed steps by
``timing.time_ms`` (wall clock and process CPU time; the table gives the medians; CPU time /
threads is what a step takes on idle cores, the number to compare on a shared machine).
**Peak extra memory** = ``VmHWM`` - baseline over the timed steps, including the returned
gradients (``[N, H] + [V, H]`` in the input dtype, the same for all); glibc serves
allocations above 64 KiB by ``mmap`` so freed buffers leave the resident set at once.

Errors (``fused_ce_patch.numerics.relative_error``, ``||a - b|| / ||b||``) of loss, dH and dW
against float64 materialised logits from the same (rounded) inputs, on the first
``--err-rows`` rows (the float64 reference at full size would take longer than the timing).

Usage::

    python benchmarks/cpu_torch_lce.py             # 2 shapes x fp32, bf16 (~20 min loaded)
    python benchmarks/cpu_torch_lce.py --quick     # N=256, H=64, V=4096 (seconds)

Writes ``benchmarks/results/cpu_torch_lce[_quick].json`` and ``.png`` and prints the table
(``--out`` elsewhere; ``--replot JSON`` redraws both from a results file).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_ce_patch.demo.memory import current_rss, peak_rss, reset_peak  # noqa: E402
from timing import time_ms  # noqa: E402  (the timer of every benchmark)

#: (N, H, V): SmolLM-135M-like H=576 / V=49152, Llama-2-like V=32000, sized for 2 CPU cores
SHAPES = ((2048, 256, 32000), (2048, 576, 49152))
QUICK = ((256, 64, 4096),)
IMPLS = ("naive", "torch-lce", "torch-lce-1024", "torch")
DEFAULT_IMPLS = ("naive", "torch-lce", "torch")
DTYPES = ("float32", "bfloat16")
RESULTS = Path(__file__).resolve().parent / "results"


# -- worker (runs in its own process) ---------------------------------------------------------


def _inputs(n, h, v, dtype, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * h**-0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::10] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def _loss_fn(impl):
    import torch
    import torch.nn.functional as F

    if impl == "naive":
        return lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y)
    if impl == "torch-lce":
        options = torch.nn.LinearCrossEntropyOptions()
        return lambda h, w, y: F.linear_cross_entropy(h, w, y, options=options)
    if impl == "torch-lce-1024":
        options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=1024)
        return lambda h, w, y: F.linear_cross_entropy(h, w, y, options=options)
    from fused_ce_patch import fused_linear_cross_entropy

    return lambda h, w, y: fused_linear_cross_entropy(h, w, y)


def _errors(fn, hidden, weight, labels, rows):
    """Relative errors of loss, dH, dW on the first ``rows`` rows against float64."""
    import torch.nn.functional as F

    from fused_ce_patch.numerics import relative_error as rel

    h = hidden.detach()[:rows].clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    y = labels[:rows]
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref = F.cross_entropy(h64 @ w64.t(), y)
    ref.backward()
    got = fn(h, w, y)
    got.backward()
    return {"loss_err": rel(got, ref), "dh_err": rel(h.grad, h64.grad),
            "dw_err": rel(w.grad, w64.grad), "loss_dtype": str(got.dtype)}  # fmt: skip


def worker(args):
    import torch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    fn = _loss_fn(args.worker)
    hidden, weight, labels = _inputs(args.n, args.h, args.v, dtype, args.seed)
    losses = []

    def step():
        loss = fn(hidden, weight, labels)
        loss.backward()
        losses.append(float(loss.detach()))

    def reset():
        hidden.grad = weight.grad = None

    step()  # warm-up: thread pools, oneDNN primitives
    reset()
    gc.collect()
    exact = reset_peak()
    base = current_rss()
    timing = time_ms(step, iters=args.repeat, reset=reset)
    peak = peak_rss()
    result = {
        "impl": args.worker, "n": args.n, "h": args.h, "v": args.v, "dtype": args.dtype,
        "ms": timing.median, "ms_all": timing.ms,
        "cpu_ms": sorted(timing.cpu_ms)[len(timing.cpu_ms) // 2] / args.threads,
        "cpu_ms_all": timing.cpu_ms,
        "peak_extra_bytes": peak - base, "baseline_rss_bytes": base,
        "peak_reset_exact": exact,
        "grads_bytes": (hidden.numel() + weight.numel()) * hidden.element_size(),
        "loss": losses[-1],
    }  # fmt: skip
    result.update(_errors(fn, hidden, weight, labels, min(args.err_rows, args.n)))
    print("RESULT " + json.dumps(result), flush=True)


# -- driver -----------------------------------------------------------------------------------


def _machine(threads):
    import torch

    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), model)  # fmt: skip
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": model, "nproc": os.cpu_count(), "threads": threads,
        "python": platform.python_version(), "torch": torch.__version__,
        "platform": platform.platform(),
    }  # fmt: skip


def _run_worker(impl, shape, dtype, args):
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    env["OMP_NUM_THREADS"] = str(args.threads)
    n, h, v = shape
    cmd = [sys.executable, __file__, "--worker", impl, "--n", str(n), "--h", str(h),
           "--v", str(v), "--dtype", dtype, "--threads", str(args.threads),
           "--repeat", str(args.repeat), "--seed", str(args.seed),
           "--err-rows", str(args.err_rows)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        return {"impl": impl, "n": n, "h": h, "v": v, "dtype": dtype,
                "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}  # fmt: skip
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def _table(rows, err_rows, threads):
    lines = [
        "| N, H, V | dtype | implementation | ms (median) | CPU ms / threads | vs naive (CPU) "
        "| peak extra MiB | vs naive | loss err | dH err | dW err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = f"{r['n']}, {r['h']}, {r['v']}"
        if "error" in r:
            lines.append(f"| {shape} | {r['dtype']} | {r['impl']} | error: {r['error']} "
                         "| | | | | | | |")  # fmt: skip
            continue
        naive = next((q for q in rows if q["impl"] == "naive" and "error" not in q
                      and (q["n"], q["h"], q["v"], q["dtype"])
                      == (r["n"], r["h"], r["v"], r["dtype"])), None)  # fmt: skip
        vs_t = f"{r['cpu_ms'] / naive['cpu_ms']:.2f}x" if naive else "-"
        vs_m = f"{r['peak_extra_bytes'] / naive['peak_extra_bytes']:.2f}x" if naive else "-"
        lines.append(
            f"| {shape} | {r['dtype']} | {r['impl']} | {r['ms']:.0f} | {r['cpu_ms']:.0f} "
            f"| {vs_t} | {r['peak_extra_bytes'] / 2**20:.0f} | {vs_m} "
            f"| {r['loss_err']:.1e} | {r['dh_err']:.1e} | {r['dw_err']:.1e} |"
        )
    lines.append(
        f"\nErrors on the first min(N, {err_rows}) rows against float64, ||a-b||/||b||. Peak extra "
        "memory includes the returned gradients ([N, H] + [V, H] in the input dtype). "
        f"{threads} thread(s)."
    )
    return "\n".join(lines)


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import plot_style

    ok = [r for r in rows if "error" not in r]
    groups = list(dict.fromkeys((r["n"], r["h"], r["v"], r["dtype"]) for r in ok))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in ok)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(impls), 1)
    for k, impl in enumerate(impls):
        for ax, key, scale in ((axes[0], "cpu_ms", 1.0), (axes[1], "peak_extra_bytes", 2**20)):
            vals = []
            for g in groups:
                r = next((r for r in ok if (r["n"], r["h"], r["v"], r["dtype"]) == g
                          and r["impl"] == impl), None)  # fmt: skip
                vals.append(r[key] / scale if r else float("nan"))
            ax.bar([i + (k - (len(impls) - 1) / 2) * width for i in range(len(groups))], vals,
                   width=width, color=plot_style.colour(impl), label=plot_style.name(impl))
    short = {"float32": "fp32", "bfloat16": "bf16"}
    labels = [f"{n}x{h}x{v}\n{short[d]}" for n, h, v, d in groups]
    for ax, title in ((axes[0], "forward + backward, CPU ms / threads (median)"),
                      (axes[1], "peak extra memory (MiB, incl. grads)")):  # fmt: skip
        ax.set_xticks(range(len(groups)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle("CPU: F.linear_cross_entropy (torch 2.13) vs fused_ce_patch vs stock "
                 "(N x H x V, dtype)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"one small shape {QUICK[0]}")
    p.add_argument("--shapes", help="N,H,V;N,H,V;... (default: the two of SHAPES)")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS))
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--repeat", type=int, default=2, help="timed steps after one warm-up")
    p.add_argument("--err-rows", type=int, default=512, help="rows of the error check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=DTYPES, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--h", type=int, help=argparse.SUPPRESS)
    p.add_argument("--v", type=int, help=argparse.SUPPRESS)
    p.add_argument("--replot", metavar="JSON", type=Path,
                   help="only reprint the table and redraw the plot of a results file")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.replot:
        data = json.loads(args.replot.read_text())
        print(_table(data["results"], data["err_rows"], data["meta"]["threads"]))
        _plot(data["results"], args.replot.with_suffix(".png"))
        return data["results"]
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    else:
        shapes = QUICK if args.quick else SHAPES
    impls = [i for i in args.impls.split(",") if i]
    dtypes = [d for d in args.dtypes.split(",") if d]
    for name, vals, allowed in (("--impls", impls, IMPLS), ("--dtypes", dtypes, DTYPES)):
        bad = [x for x in vals if x not in allowed]
        if bad:
            p.error(f"{name}: unknown {bad}; choose from {list(allowed)}")
    load_before = os.getloadavg()
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            for impl in impls:
                print(f"{shape} {dtype} {impl} ...", file=sys.stderr, flush=True)
                rows.append(_run_worker(impl, shape, dtype, args))
    meta = _machine(args.threads)
    meta["loadavg_before"], meta["loadavg_after"] = load_before, os.getloadavg()
    table = _table(rows, args.err_rows, args.threads)
    print(table)
    print(f"\n{meta['date']} | {meta['cpu']}, nproc={meta['nproc']}, threads={args.threads} | "
          f"python {meta['python']}, torch {meta['torch']} | load average before/after "
          f"{load_before[0]:.1f}/{meta['loadavg_after'][0]:.1f}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "cpu_torch_lce_quick" if args.quick else "cpu_torch_lce"
    data = {"shapes": shapes, "dtypes": dtypes, "repeat": args.repeat,
            "err_rows": args.err_rows, "meta": meta, "results": rows,
            "table_markdown": table}  # fmt: skip
    (args.out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    _plot(rows, args.out / f"{stem}.png")
    print(f"wrote {args.out / (stem + '.json')} and .png", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()

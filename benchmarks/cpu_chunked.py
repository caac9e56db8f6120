"""CPU benchmark: backend ``"torch"`` (chunked) against the naive materialised-logits loss.

Question: on CPU in float32, what do forward+backward time and peak extra memory cost for
``fused_linear_cross_entropy(..., backend="torch")`` at its default budget, compared with

    naive:  F.cross_entropy((hidden @ weight.T).float(), labels)   then .backward()

Each measurement runs in a fresh subprocess (so one's freed memory cannot hide the other's
peak), and the implementations alternate over ``--rounds`` rounds, so a busy neighbour on a
shared machine slows both alike. In each subprocess:

1. inputs are allocated (hidden ``[N, H]``, weight ``[V, H]``, both float32 and requiring grad,
   labels ``[N]``) and one warm-up forward+backward runs;
2. the grads are dropped, the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``) and
   the baseline ``VmRSS`` is read;
3. ``--repeat`` timed forward+backward steps run (grads dropped between steps); each is
   timed by the wall clock and by the process's CPU time (all threads; divided by the thread
   count it is the wall time the step would take on otherwise idle cores);
4. **peak extra memory** = ``VmHWM`` (peak resident set since the reset) - baseline: every
   byte the step needed on top of its inputs, *including* the gradients it returns
   (``weight.grad`` alone is ``V * H * 4`` bytes, the same for both implementations).

glibc is told to serve every allocation above 64 KiB with ``mmap`` (``MALLOC_MMAP_THRESHOLD_``)
so freed buffers leave the resident set at once and RSS tracks live memory in both processes.

The error columns are always measured at the quick size (float32 result against a float64
loss computed from materialised float64 logits, relative error of the whole tensor
``||a - b|| / ||b||``).

Usage::

    python benchmarks/cpu_chunked.py            # N=4096, H=1024, V=128256 (minutes)
    python benchmarks/cpu_chunked.py --quick    # N=512,  H=256,  V=8192

Writes ``benchmarks/results/cpu_chunked[_quick].json`` and ``.png``.
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
from timing import time_ms  # noqa: E402  (the timer of every benchmark)

from fused_ce_patch.demo.memory import current_rss, peak_rss, reset_peak  # noqa: E402

FULL = dict(n=4096, h=1024, v=128256)
QUICK = dict(n=512, h=256, v=8192)
IMPLS = ("naive", "torch")
RESULTS = Path(__file__).resolve().parent / "results"


# -- worker (runs in its own process) ---------------------------------------------------------


def _inputs(n, h, v, seed, requires_grad=True):
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * h**-0.5  # logits of unit scale
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden.requires_grad_(requires_grad), weight.requires_grad_(requires_grad), labels


def _step_fn(impl):
    import torch.nn.functional as F

    from fused_ce_patch import fused_linear_cross_entropy

    if impl == "naive":

        def step(hidden, weight, labels):
            # No name holds the logits, so they die as early as autograd allows.
            loss = F.cross_entropy((hidden @ weight.t()).float(), labels)
            loss.backward()
            return loss

    else:

        def step(hidden, weight, labels):
            loss = fused_linear_cross_entropy(hidden, weight, labels, backend=impl)
            loss.backward()
            return loss

    return step


def _errors(impl, seed):
    """Relative error of loss, dH and dW against float64, at the quick size."""
    import torch
    import torch.nn.functional as F

    hidden, weight, labels = _inputs(**QUICK, seed=seed + 1)
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = F.cross_entropy(h64 @ w64.t(), labels)
    ref.backward()
    got = _step_fn(impl)(hidden, weight, labels)

    from fused_ce_patch.numerics import relative_error as rel

    return {
        "loss_err": rel(got.detach(), ref.detach()),
        "dh_err": rel(hidden.grad, h64.grad),
        "dw_err": rel(weight.grad, w64.grad),
    }


def worker(args):
    import torch

    torch.set_num_threads(args.threads)
    step = _step_fn(args.worker)
    hidden, weight, labels = _inputs(args.n, args.h, args.v, seed=args.seed)

    step(hidden, weight, labels)  # warm-up: thread pools, oneDNN/MKL primitives
    hidden.grad = weight.grad = None
    gc.collect()
    exact = reset_peak()
    base = current_rss()
    losses = []

    def reset():
        hidden.grad = weight.grad = None

    timing = time_ms(lambda: losses.append(step(hidden, weight, labels)), iters=args.repeat,
                     reset=reset)  # fmt: skip
    loss = losses[-1]
    times = [ms / 1e3 for ms in timing.ms]
    cpu_times = [ms / 1e3 / args.threads for ms in timing.cpu_ms]
    peak = peak_rss()
    grads_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    result = {
        "impl": args.worker,
        "times_s": times,
        "cpu_times_s": cpu_times,
        "peak_extra_bytes": peak - base,
        "baseline_rss_bytes": base,
        "grads_bytes": grads_bytes,
        "peak_reset_exact": exact,
        "loss": float(loss),
    }
    result.update(_errors(args.worker, args.seed))
    print("RESULT " + json.dumps(result), flush=True)


# -- driver -----------------------------------------------------------------------------------


def _machine():
    import torch

    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from fused_ce_patch.backends import torch_chunked

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": model,
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "torch_default_budget_bytes": torch_chunked.DEFAULT_BUDGET,
    }


def _run_worker(impl, args, size):
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [
        sys.executable, __file__, "--worker", impl,
        "--n", str(size["n"]), "--h", str(size["h"]), "--v", str(size["v"]),
        "--threads", str(args.threads), "--repeat", str(args.repeat), "--seed", str(args.seed),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"worker {impl} failed with exit code {proc.returncode}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def _summarise(runs):
    """One row per implementation from all its rounds: the fastest step (wall and CPU), the
    largest peak (conservative), the errors of the first round."""
    rows = []
    for impl in IMPLS:
        mine = [r for r in runs if r["impl"] == impl]
        row = dict(mine[0])
        row["time_s"] = min(t for r in mine for t in r["times_s"])
        row["cpu_time_s"] = min(t for r in mine for t in r["cpu_times_s"])
        row["peak_extra_bytes"] = max(r["peak_extra_bytes"] for r in mine)
        row["rounds"] = mine
        rows.append(row)
    return rows


def _table(rows, size, threads):
    naive = next(r for r in rows if r["impl"] == "naive")
    head = (
        f"N={size['n']}, H={size['h']}, V={size['v']}, float32, {threads} threads\n\n"
        "| implementation | wall time (s) | CPU time / threads (s) | vs naive (CPU) "
        "| peak extra memory (MiB) | vs naive | loss err* | dH err* | dW err* |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['time_s']:.2f} | {r['cpu_time_s']:.2f} "
            f"| {r['cpu_time_s'] / naive['cpu_time_s']:.2f}x "
            f"| {r['peak_extra_bytes'] / 2**20:.0f} "
            f"| {r['peak_extra_bytes'] / naive['peak_extra_bytes']:.3f}x "
            f"| {r['loss_err']:.1e} | {r['dh_err']:.1e} | {r['dw_err']:.1e} |"
        )
    lines.append(
        f"\n*errors at the quick size N={QUICK['n']}, H={QUICK['h']}, V={QUICK['v']} against "
        "float64, ||a-b||/||b||. Times: fastest forward+backward step over all rounds. Peak "
        "extra memory: largest over the rounds, and it includes the returned gradients "
        f"({rows[0]['grads_bytes'] / 2**20:.0f} MiB, equal for both)."
    )
    return "\n".join(lines)


def _plot(rows, size, path, threads=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import plot_style

    impls = [r["impl"] for r in rows]
    names = [plot_style.name(i).replace(" (", "\n(") for i in impls]
    colours = [plot_style.colour(i) for i in impls]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    x = list(range(len(impls)))
    a.bar([i - 0.2 for i in x], [r["time_s"] for r in rows], width=0.4, color=colours,
          label="wall")  # fmt: skip
    a.bar([i + 0.2 for i in x], [r["cpu_time_s"] for r in rows], width=0.4, color=colours,
          alpha=0.55, hatch="//", label="CPU time / threads")  # fmt: skip
    a.set_xticks(x, names, fontsize=8)
    a.set_ylabel("forward + backward (s)")
    a.set_ylim(top=1.3 * max(max(r["time_s"], r["cpu_time_s"]) for r in rows))
    a.legend(loc="upper center", ncol=2, fontsize=8)
    mib = [r["peak_extra_bytes"] / 2**20 for r in rows]
    b.bar(x, mib, color=colours)
    b.set_xticks(x, names, fontsize=8)
    b.set_ylabel("peak extra memory (MiB)")
    if plot_style.wants_log_axis(mib):
        b.set_yscale("log")
        b.set_ylabel("peak extra memory (MiB, log scale)")
    n = size["n"]
    fig.suptitle(
        f"CPU, float32, {n:,} tokens x vocabulary {size['v']:,} (H={size['h']})"
        + (f", {threads} threads" if threads else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"small size {QUICK}")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CI: 2)")
    p.add_argument("--repeat", type=int, default=1, help="timed steps after one warm-up")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (fresh processes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replot", metavar="JSON", help="only redraw the plot of a results file")
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--h", type=int, help=argparse.SUPPRESS)
    p.add_argument("--v", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        png = Path(args.replot).with_suffix(".png")
        _plot(data["results"], data["size"], png, data.get("threads"))
        print(f"wrote {png}", file=sys.stderr)
        return None

    size = QUICK if args.quick else FULL
    load_before = os.getloadavg()
    runs = []
    for rnd in range(args.rounds):
        for impl in IMPLS:
            print(f"round {rnd + 1}/{args.rounds}: {impl} ...", file=sys.stderr, flush=True)
            runs.append(_run_worker(impl, args, size))
    rows = _summarise(runs)
    table = _table(rows, size, args.threads)
    meta = _machine()
    meta["loadavg_before"] = load_before
    meta["loadavg_after"] = os.getloadavg()
    print(table)
    print(
        f"\n{meta['date']} | {meta['cpu']}, nproc={meta['nproc']}, threads={args.threads} | "
        f"python {meta['python']}, torch {meta['torch']} | torch backend default budget "
        f"{meta['torch_default_budget_bytes'] / 2**20:.0f} MiB | load average before/after "
        f"{load_before[0]:.1f}/{meta['loadavg_after'][0]:.1f}"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "cpu_chunked_quick" if args.quick else "cpu_chunked"
    data = {"size": size, "threads": args.threads, "repeat": args.repeat, "rounds": args.rounds,
            "meta": meta, "results": rows, "table_markdown": table}  # fmt: skip
    (RESULTS / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    _plot(rows, size, RESULTS / f"{stem}.png", args.threads)
    print(f"wrote {RESULTS / (stem + '.json')} and .png", file=sys.stderr)


if __name__ == "__main__":
    main()

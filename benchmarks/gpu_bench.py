"""Fused linear cross-entropy on one GPU: backend "triton" (both paths) beside its peers.

Question: at the shapes of issue 5, how fast is forward+backward (grads of hidden and weight),
how much memory does it take beyond its inputs and the gradients themselves, and how close
are the loss and gradients to a float32 reference?

Implementations (each skipped with a printed reason where it cannot run):
    ours-chunked     fused_linear_cross_entropy(backend="triton") at the default budget (the
                     speed policy: backends.triton.default_budget)
    ours-256mib      logits_budget=256 MiB, the documented memory-first setting
    ours-zero        logits_budget=0 (no logits in device memory)
    ours-zero-tiled  logits_budget=0 with the in-place backward switched off: the tiled
                     kernels with float32 atomics (the zero-logits backward before 2026-12-02)
    torch-naive      F.linear in bf16, logits.float(), F.cross_entropy (HF's stock path)
    torch-compile    the same function under torch.compile
    liger            Liger-Kernel LigerFusedLinearCrossEntropyLoss
    cce              Cut Cross-Entropy linear_cross_entropy, default (gradient filtering)
    cce-exact        the same with filter_eps=None
    cce-compile      Cut Cross-Entropy impl="torch_compile"
    trl-head         TRL's fused LM head kernel (trl.kernels.ChunkedLogProbFunction, log-probs
                     only, counted rows, as its trainers call it); loss = mean of -log p
                     (the trl wheel must be importable; benchmarks/gpu_trl_head.py has more)
    cublas-3gemm     not a loss: the three matmuls (logits, dH, dW) on the counted rows

Method: random bf16 inputs (hidden ~ N(0, 1), weight ~ N(0, 1/H): logits of std ~1), 10% of
labels ignored; mean reduction. Time: median of ``--iters`` (>= 15) fwd+bwd timed with CUDA
events after ``--warmup`` runs. Memory: ``torch.cuda.max_memory_allocated`` during one
fwd+bwd, minus what was allocated before it, minus the bf16 dH and dW ("extra"). Errors:
``||x - ref|| / ||ref||`` for loss, dH and dW against float32 materialised logits computed
from the same bf16 inputs.

Writes ``gpu_bench.json`` and ``gpu_bench.png`` under ``--out`` (default ``$OUT`` or
``benchmarks/results``) and prints the table. ``--tiny`` runs a CPU dry run (Triton
interpreter) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_ms  # noqa: E402  (the timer of every benchmark)

SHAPES = {
    # name: (N, H, V, softcap)
    "llama3-8b": (8192, 4096, 128256, None),
    "gemma2-2b": (8192, 2304, 256000, 30.0),
    "qwen2.5-7b": (8192, 3584, 152064, None),
    "llama2-7b": (8192, 4096, 32000, None),
    "llama3-8b-long": (32768, 4096, 128256, None),
    "gemma3-270m": (32768, 640, 262144, None),
}
TINY = {"tiny": (64, 32, 1003, None), "tiny-softcap": (48, 24, 517, 30.0)}
IMPLS = ["ours-chunked", "ours-256mib", "ours-zero", "ours-zero-tiled", "torch-naive",
         "torch-compile", "liger", "cce", "cce-exact", "cce-compile", "trl-head",
         "cublas-3gemm"]  # fmt: skip
MiB = 2**20


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tag", default="gpu_bench")
    p.add_argument("--tiny", action="store_true", help="CPU dry run under the interpreter")
    p.add_argument("--replot", metavar="JSON", help="redraw the PNG of an earlier run's JSON")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as f:
            data = json.load(f)
        save(args, data["env"], data["rows"], plot=True)
        return
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dev = "cpu" if args.tiny else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = TINY if args.tiny else {k: SHAPES[k] for k in args.shapes.split(",")}
    impls = args.impls.split(",")
    env = environment(torch, dev)
    print(json.dumps(env), flush=True)

    rows = []
    for name, (n, h, v, softcap) in shapes.items():
        print(f"\n== {name}: N={n} H={h} V={v} softcap={softcap}", flush=True)
        data = make_inputs(torch, n, h, v, dev)
        ref = reference(torch, data, softcap)
        for impl in impls:
            t0 = time.time()
            try:
                fn = build(torch, impl, softcap, dev)
                if fn is None:
                    continue
                row = measure(torch, fn, data, ref, args, dev, time_only=impl == "cublas-3gemm")
            except Exception as exc:  # one failing peer must not end the run
                traceback.print_exc()
                row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            row.update(shape=name, impl=impl, N=n, H=h, V=v, softcap=softcap,
                       wall_s=round(time.time() - t0, 1))  # fmt: skip
            rows.append(row)
            print(fmt_row(row), flush=True)
            cleanup(torch, dev)
        del data, ref
        cleanup(torch, dev)
        save(args, env, rows)
    print_table(rows)
    save(args, env, rows, plot=True)


# -- inputs and reference -------------------------------------------------------------------


def make_inputs(torch, n, h, v, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(n, h, device=dev, generator=g).bfloat16()
    weight = (torch.randn(v, h, device=dev, generator=g) / math.sqrt(h)).bfloat16()
    labels = torch.randint(0, v, (n,), device=dev, generator=g)
    labels[torch.rand(n, device=dev, generator=g) < 0.1] = -100
    return {"hidden": hidden, "weight": weight, "labels": labels}


def reference(torch, data, softcap):
    """float32 loss, dH, dW through materialised logits (the same bf16 inputs, upcast)."""
    import torch.nn.functional as F

    h = data["hidden"].float().requires_grad_()
    w = data["weight"].float().requires_grad_()
    z = F.linear(h, w)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, data["labels"])
    dh, dw = torch.autograd.grad(loss, [h, w])
    del z
    return {"loss": loss.detach(), "dh": dh, "dw": dw}


# -- implementations ------------------------------------------------------------------------


def build(torch, impl, softcap, dev):
    """A function ``(hidden, weight, labels) -> loss`` for ``impl``, or None to skip."""
    import torch.nn.functional as F

    def naive(hidden, weight, labels):
        z = F.linear(hidden, weight).float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        return F.cross_entropy(z, labels)

    if impl.startswith("ours"):
        from fused_ce_patch import fused_linear_cross_entropy

        from fused_ce_patch.backends.triton import zero_logits_inplace

        budget = {"ours-chunked": None, "ours-256mib": 256 * MiB, "ours-zero": 0,
                  "ours-zero-tiled": 0}  # fmt: skip
        b = budget[impl]

        def ours(hd, w, y):
            # read in backward, which each timed step runs right after this forward
            zero_logits_inplace.ENABLED = impl != "ours-zero-tiled"
            return fused_linear_cross_entropy(hd, w, y, softcap=softcap, logits_budget=b,
                                              backend="triton")  # fmt: skip

        return ours
    if impl == "torch-naive":
        return naive
    if impl == "torch-compile":
        return torch.compile(naive)
    if impl == "cublas-3gemm":

        def three(hidden, weight, labels):
            h = hidden[labels != -100]
            z = h @ weight.t()
            return (z @ weight, z.t() @ h)

        return three
    if dev != "cuda":
        print(f"skip {impl}: needs CUDA")
        return None
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        mod = LigerFusedLinearCrossEntropyLoss(softcap=softcap)
        return lambda hd, w, y: mod(w, hd, y)
    if impl == "trl-head":
        from trl_head_impls import build as build_trl_head

        return build_trl_head(torch, "trl-logp", softcap)
    if impl.startswith("cce"):
        from cut_cross_entropy import linear_cross_entropy

        kw = {
            "cce": {},
            "cce-exact": {"filter_eps": None},
            "cce-compile": {"impl": "torch_compile"},
        }
        return lambda hd, w, y: linear_cross_entropy(hd, w, y, softcap=softcap, **kw[impl])
    raise ValueError(impl)


# -- measurement ----------------------------------------------------------------------------


def measure(torch, fn, data, ref, args, dev, time_only=False):
    from fused_ce_patch.numerics import relative_error as rel

    hidden = data["hidden"].detach().requires_grad_()
    weight = data["weight"].detach().requires_grad_()
    labels = data["labels"]

    def step():
        out = fn(hidden, weight, labels)
        if not time_only:
            out.backward()
        return out

    row = {}
    if not time_only:
        loss = step()
        row["err_loss"] = rel(loss.detach(), ref["loss"])
        row["err_dh"] = rel(hidden.grad, ref["dh"])
        row["err_dw"] = rel(weight.grad, ref["dw"])
        hidden.grad = weight.grad = None
        del loss
    for _ in range(args.warmup):
        step()
        hidden.grad = weight.grad = None
    sync(torch, dev)
    if dev == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        sync(torch, dev)
        grads = 0 if time_only else (hidden.numel() + weight.numel()) * 2
        row["extra_mib"] = (torch.cuda.max_memory_allocated() - base - grads) / MiB
        del out
        hidden.grad = weight.grad = None
    def reset():
        hidden.grad = weight.grad = None

    timing = time_ms(step, iters=max(args.iters, 1), device=dev, reset=reset)
    row["ms"], row["ms_min"], row["ms_max"] = timing.median, timing.min, timing.max
    return row


def sync(torch, dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def cleanup(torch, dev):
    import gc

    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


# -- output ---------------------------------------------------------------------------------


def environment(torch, dev):
    import triton

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": dev,
    }
    if dev == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip()
        except Exception as exc:
            env["driver"] = f"unknown ({exc})"
    for mod in ("liger_kernel", "cut_cross_entropy", "transformers"):
        try:
            from importlib.metadata import version

            env[mod] = version(mod.replace("_", "-"))
        except Exception:
            env[mod] = None
    return env


def fmt_row(r):
    if "error" in r:
        return f"{r['shape']:<15} {r['impl']:<16} ERROR {r['error']}"
    parts = [f"{r['shape']:<15} {r['impl']:<16} {r['ms']:9.2f} ms"]
    if "extra_mib" in r:
        parts.append(f"{r['extra_mib']:9.1f} MiB")
    if "err_dh" in r:
        parts.append(f"loss {r['err_loss']:.1e} dH {r['err_dh']:.1e} dW {r['err_dw']:.1e}")
    return "  ".join(parts)


def print_table(rows):
    print("\n| shape | impl | ms (median) | extra MiB | err loss | err dH | err dW |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['impl']} | error: {r['error'][:80]} | | | | |")
            continue
        e = [f"{r[k]:.1e}" if k in r else "" for k in ("err_loss", "err_dh", "err_dw")]
        x = f"{r['extra_mib']:.0f}" if "extra_mib" in r else ""
        print(f"| {r['shape']} | {r['impl']} | {r['ms']:.1f} | {x} | {e[0]} | {e[1]} | {e[2]} |")


def save(args, env, rows, plot=False):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    if not plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import plot_style

    ok = [r for r in rows if "ms" in r and r["impl"] != "cublas-3gemm"]
    shapes = list(dict.fromkeys(r["shape"] for r in ok))
    order = list(plot_style.STYLE)
    impls = sorted(dict.fromkeys(r["impl"] for r in ok),
                   key=lambda i: order.index(i) if i in order else len(order))  # fmt: skip
    dims = {r["shape"]: r for r in ok}
    ticks = [f"{s}\nN={dims[s]['N']:,}\nV={dims[s]['V']:,}" for s in shapes]
    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    width = 0.8 / max(len(impls), 1)
    for k, (key, label) in enumerate((("ms", "forward + backward, ms (median)"),
                                      ("extra_mib", "memory beyond inputs and gradients, MiB"))):  # fmt: skip
        ax = axes[k]
        every = []
        for i, impl in enumerate(impls):
            vals = [next((r.get(key, math.nan) for r in ok
                          if r["shape"] == s and r["impl"] == impl), math.nan)
                    for s in shapes]  # fmt: skip  (NaN: not measured, no bar)
            every += vals
            ax.bar([j + i * width for j in range(len(shapes))], [max(x, 0.1) for x in vals],
                   width, label=plot_style.name(impl), color=plot_style.colour(impl))  # fmt: skip
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], ticks, fontsize=8)
        ax.set_ylabel(label + (" (log scale)" if plot_style.wants_log_axis(every) else ""))
        if plot_style.wants_log_axis(every):  # one bar would dwarf the rest on a linear axis
            ax.set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8)
    fig.suptitle(
        f"Linear + cross-entropy, bf16 inputs, N tokens x vocabulary V (per group); "
        f"{env.get('gpu', env['device'])}, torch {env['torch']}, triton {env['triton']}"
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(os.path.join(args.out, f"{args.tag}.png"), dpi=110)


if __name__ == "__main__":
    main()

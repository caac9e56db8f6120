"""float16 with loss scaling: gradient accuracy and time, PyTorch's path against ours (issue 9.1).

Question: under fp16 autocast with the loss multiplied by a scale before backward (what
``torch.amp.GradScaler`` and ``Trainer(fp16=True)`` do), are our gradients, divided by the
scale, as close to float64 as PyTorch's own path, and what does the fix cost in time?

Implementations:
    torch         F.linear under autocast (fp16 logits), logits.float(), F.cross_entropy
    ours          fused_linear_cross_entropy, backend "triton", default budget: float16 now
                  recomputes the logits in backward (chunked.forward_grad_safe)
    ours-eager    the same with the forward-time gradient forced on (the behaviour before the
                  fix: gradient rounded to fp16 at scale 1/N in forward, scaled afterwards)
    ours-zero     logits_budget=0 (zero-logits kernels, always recompute)
    ours-bf16     default budget under bf16 autocast (keeps the forward-time gradient), for
                  the time the forward-time gradient saves

Method: float32 master hidden ~ N(0, 1) and weight ~ N(0, 1) * 0.02 (an lm_head at init),
10% of labels ignored, mean reduction, autocast to the implementation's dtype;
``(loss * scale).backward()``; errors ``||g / scale - ref|| / ||ref||`` for dH and dW against
float64 gradients of the same fp16-rounded inputs, and the fraction of gradient entries that
are exactly zero where float64's are not. Time: median of ``--iters`` fwd+bwd with CUDA events
after ``--warmup``. Writes ``gpu_fp16.json`` and ``gpu_fp16.png`` under ``--out`` (default
``$OUT`` or ``benchmarks/results``). ``--tiny`` is a CPU dry run under the Triton interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

SHAPES = {
    # name: (N, H, V)
    "issue-9": (8192, 256, 32000),
    "llama3-8b": (8192, 4096, 128256),
}
TINY = {"tiny": (96, 16, 509)}
IMPLS = ["torch", "ours", "ours-eager", "ours-zero", "ours-bf16"]
SCALES = (1.0, 65536.0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--tiny", action="store_true", help="CPU dry run (Triton interpreter)")
    args = p.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.getcwd())
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from gpu_bench import environment

    dev = "cpu" if args.tiny else "cuda"
    shapes = TINY if args.tiny else {k: SHAPES[k] for k in args.shapes.split(",")}
    iters, warmup = (2, 1) if args.tiny else (args.iters, args.warmup)
    impls = args.impls.split(",")
    rows = []
    for name, (n, h, v) in shapes.items():
        torch.manual_seed(0)
        hidden = torch.randn(n, h, device=dev)
        weight = torch.randn(v, h, device=dev) * 0.02
        labels = torch.randint(0, v, (n,), device=dev)
        labels[torch.rand(n, device=dev) < 0.1] = -100
        refs = {dt: reference(hidden, weight, labels, dt) for dt in (torch.float16, torch.bfloat16)}
        for impl in impls:
            for scale in SCALES:
                row = {"shape": name, "N": n, "H": h, "V": v, "impl": impl, "scale": scale}
                try:
                    row.update(measure(impl, hidden, weight, labels, scale, refs, dev, iters,
                                       warmup))  # fmt: skip
                except Exception as exc:  # one failure must not lose the other rows
                    traceback.print_exc()
                    row["error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                print(fmt_row(row), flush=True)
        del refs
    os.makedirs(args.out, exist_ok=True)
    result = {"environment": environment(torch, dev), "rows": rows}
    with open(os.path.join(args.out, "gpu_fp16.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, os.path.join(args.out, "gpu_fp16.png"), result["environment"])


def reference(hidden, weight, labels, dtype):
    """float64 gradients (dH, dW) of the mean loss at the inputs rounded to ``dtype``."""
    import torch
    import torch.nn.functional as F

    h = hidden.to(dtype).double().requires_grad_()
    w = weight.to(dtype).double().requires_grad_()
    F.cross_entropy(h @ w.t(), labels).backward()
    return h.grad, w.grad


def loss_fn(impl):
    import torch.nn.functional as F

    from fused_ce_patch import fused_linear_cross_entropy

    if impl == "torch":
        return lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y)
    budget = 0 if impl == "ours-zero" else None
    return lambda h, w, y: fused_linear_cross_entropy(h, w, y, backend="triton",
                                                      logits_budget=budget)  # fmt: skip


def measure(impl, hidden, weight, labels, scale, refs, dev, iters, warmup):
    import torch

    from fused_ce_patch.backends import chunked

    dtype = torch.bfloat16 if impl == "ours-bf16" else torch.float16
    fn = loss_fn(impl)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()

    def step():
        h.grad = w.grad = None
        with torch.autocast(dev, dtype=dtype):
            loss = fn(h, w, labels)
        (loss * scale).backward()

    saved = chunked.forward_grad_safe
    if impl == "ours-eager":  # the schedule before the fix
        chunked.forward_grad_safe = lambda dt: True
    try:
        step()
        ref_h, ref_w = refs[dtype]
        out = {}
        for key, g, r in (("dh", h.grad, ref_h), ("dw", w.grad, ref_w)):
            g = g.double() / scale
            out[f"err_{key}"] = float((g - r).norm() / r.norm())
            out[f"zero_{key}"] = float(((g == 0) & (r != 0)).double().mean())
            out[f"finite_{key}"] = bool(torch.isfinite(g).all())
        out["ms"] = timed(step, dev, iters, warmup)
    finally:
        chunked.forward_grad_safe = saved
    return out


def timed(step, dev, iters, warmup):
    from timing import time_ms

    return time_ms(step, iters=iters, warmup=warmup, device=dev).median


def fmt_row(r):
    head = f"{r['shape']:<10} {r['impl']:<11} scale {r['scale']:<8g}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    return (f"{head} {r['ms']:9.2f} ms  dH {r['err_dh']:.2e} (zero {r['zero_dh']:.1%})  "
            f"dW {r['err_dw']:.2e} (zero {r['zero_dw']:.1%})")  # fmt: skip


def plot(rows, path, env):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    shapes = sorted({r["shape"] for r in ok}, key=[r["shape"] for r in ok].index)
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        these = [r for r in ok if r["shape"] == shape]
        labels = [f"{r['impl']}\nx{r['scale']:g}" for r in these]
        ax.bar(range(len(these)), [r["err_dh"] for r in these])
        ax.set_yscale("log")
        ax.set_xticks(range(len(these)), labels, fontsize=7)
        r0 = these[0]
        ax.set_title(f"{shape}: N={r0['N']}, H={r0['H']}, V={r0['V']}; fp16 (bf16 where named)")
        ax.set_ylabel("dH relative error vs float64")
    fig.suptitle(f"loss scaling, {env.get('gpu', env['device'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

"""Fused distillation loss (generalized JSD of GKD) on one GPU: fused_linear_jsd beside TRL's
and Liger's.

Question: at N = 8192 tokens, V = 128256, student H = 2048, teacher H = 4096 (bf16, ~10% of
labels ignored, loss averaged over the counted tokens), how fast is forward + backward (grads
of the student's hidden states and lm_head weight; the teacher frozen), how much memory does
it take beyond its inputs and the student's gradients, and how close are the loss and the
gradients to a float32 materialised reference?

Implementations (each skipped with a printed reason where it cannot run):
    ours          fused_ce_patch.fused_linear_jsd, backend "auto" (the Triton row kernel on
                  CUDA), default budget
    ours-entropy  the same, also returning the student's per-token entropy (as TRL's does)
    ours-torch    fused_linear_jsd(backend="torch"): the torch-ops row arithmetic
    ours@M        ours at logits_budget = M MiB (the default is 384 MiB on CUDA)
    trl-chunked   TRL's DistillationTrainer loss: trl.trainer.distillation_trainer.
                  _chunked_divergence_loss, i.e. trl.kernels.ChunkedDivergenceFunction on the
                  counted rows (it also computes the entropy)
    liger         Liger-Kernel LigerFusedLinearJSD (jsd_beta = beta; its mixture and KL
                  order are TRL's)
    trl-gkd       TRL's GKDTrainer.generalized_jsd_loss on materialised bf16 logits (the
                  experimental GKDTrainer's path)

Method: random bf16 inputs (hidden ~ N(0, 1), weights ~ N(0, 1/H): logits of std ~1),
``labels`` with 10% ignored (-100). Time: median of ``--iters`` fwd+bwd timed with CUDA
events after ``--warmup`` runs (benchmarks/timing.py). Memory: peak of
``torch.cuda.max_memory_allocated`` during one fwd+bwd minus what was allocated before it,
minus the bf16 dH and dW of the student ("extra"). Errors: ``||x - ref|| / ||ref||`` for the
loss, dH and dW against float32 materialised logits from the same bf16 inputs (GKD Eq. 1,
TRL's conventions).

Writes ``gpu_jsd.json`` and ``gpu_jsd.png`` under ``--out`` (default ``$OUT`` or
``benchmarks/results``) and prints the table. ``--smoke`` runs tiny shapes on the CPU (Triton
interpreter for ours) to check the script itself.

GPU run (coordinator), from the repo root with the liger-kernel and trl wheels in .whl/::

    bash benchmarks/gpu_run.sh script=gpu_jsd:540
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_ms  # noqa: E402

SHAPES = {"llama3-1b<-8b": (8192, 2048, 4096, 128256)}  # name: (N, H_student, H_teacher, V)
SMOKE = {"smoke": (48, 24, 40, 517)}
IMPLS = ["ours", "ours-entropy", "ours-torch", "ours@192", "ours@768", "trl-chunked", "liger",
         "trl-gkd"]
MiB = 2**20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--betas", default="0.5,0.0,1.0")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tag", default="gpu_jsd")
    p.add_argument("--smoke", action="store_true", help="CPU dry run at tiny shapes")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dev = "cpu" if args.smoke else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = SMOKE if args.smoke else SHAPES
    env = environment(torch, dev)
    print(json.dumps(env), flush=True)
    rows = []
    for name, (n, hs, ht, v) in shapes.items():
        data = make_inputs(torch, n, hs, ht, v, dev)
        for beta in [float(b) for b in args.betas.split(",")]:
            print(f"\n== {name}: N={n} Hs={hs} Ht={ht} V={v} beta={beta}", flush=True)
            ref = reference(torch, data, beta)
            for impl in args.impls.split(","):
                t0 = time.time()
                try:
                    fn = build(torch, impl, beta, dev)
                    if fn is None:
                        continue
                    row = measure(torch, fn, data, ref, args, dev)
                except Exception as exc:  # one failing peer must not end the run
                    traceback.print_exc()
                    row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                row.update(shape=name, impl=impl, beta=beta, N=n, Hs=hs, Ht=ht, V=v,
                           wall_s=round(time.time() - t0, 1))
                rows.append(row)
                print(fmt_row(row), flush=True)
                cleanup(torch, dev)
            del ref
            cleanup(torch, dev)
            save(args, env, rows)
    print_table(rows)
    save(args, env, rows, plot=True)
    return rows


# -- inputs and reference -------------------------------------------------------------------


def make_inputs(torch, n, hs, ht, v, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    return {
        "hs": torch.randn(n, hs, device=dev, generator=g).bfloat16(),
        "ws": (torch.randn(v, hs, device=dev, generator=g) / math.sqrt(hs)).bfloat16(),
        "ht": torch.randn(n, ht, device=dev, generator=g).bfloat16(),
        "wt": (torch.randn(v, ht, device=dev, generator=g) / math.sqrt(ht)).bfloat16(),
        "labels": torch.where(torch.rand(n, device=dev, generator=g) < 0.1, -100,
                              torch.randint(0, v, (n,), device=dev, generator=g)),
    }


def jsd_rows(torch, zs, zt, beta):
    """Per-row generalized JSD of float logits (GKD Eq. 1, TRL's conventions)."""
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    if beta == 0.0:
        return (lt.exp() * (lt - ls)).sum(-1)
    if beta == 1.0:
        return (ls.exp() * (ls - lt)).sum(-1)
    log_m = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return beta * (lt.exp() * (lt - log_m)).sum(-1) + (1 - beta) * (ls.exp() * (ls - log_m)).sum(-1)


def reference(torch, data, beta):
    """float32 loss, dH, dW through materialised logits (the same bf16 inputs, upcast), in
    row blocks so the float32 temporaries stay a few GiB."""
    mask = data["labels"] != -100
    hs = data["hs"][mask].float()
    ht = data["ht"][mask].float()
    ws = data["ws"].float().requires_grad_()
    wt = data["wt"].float()
    count = hs.shape[0]
    loss = torch.zeros((), device=hs.device)
    dh = torch.empty_like(hs)
    dw = torch.zeros_like(ws)
    for s in range(0, count, 1024):
        h = hs[s:s + 1024].requires_grad_()
        d = jsd_rows(torch, h @ ws.t(), ht[s:s + 1024] @ wt.t(), beta).sum() / count
        gh, gw = torch.autograd.grad(d, [h, ws])
        dh[s:s + 1024], loss = gh, loss + d.detach()
        dw += gw
    full_dh = torch.zeros(data["hs"].shape, device=hs.device)
    full_dh[mask] = dh
    return {"loss": loss, "dh": full_dh, "dw": dw}


# -- implementations ------------------------------------------------------------------------


def build(torch, impl, beta, dev):
    """A function ``(hs, ws, ht, wt, labels) -> scalar loss`` for ``impl``, or None."""
    if impl in ("ours", "ours-entropy", "ours-torch") or impl.startswith("ours@"):
        from fused_ce_patch import fused_linear_jsd

        backend = "torch" if impl == "ours-torch" else ("triton" if dev == "cpu" else "auto")
        budget = int(float(impl[5:]) * MiB) if impl.startswith("ours@") else None
        if dev == "cpu" and budget is not None:
            budget //= 4096  # the smoke shapes: still several chunks

        def ours(hs, ws, ht, wt, y):
            out = fused_linear_jsd(hs, ws, ht, wt, y, beta=beta, backend=backend,
                                   logits_budget=budget,
                                   return_student_entropy=impl == "ours-entropy")
            return out[0] if isinstance(out, tuple) else out

        return ours
    if impl == "trl-gkd":
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from trl.experimental.gkd.gkd_trainer import GKDTrainer

        def gkd(hs, ws, ht, wt, y):
            with torch.no_grad():
                zt = ht @ wt.t()
            return GKDTrainer.generalized_jsd_loss(hs @ ws.t(), zt, y, beta=beta)

        return gkd
    if impl == "trl-chunked":
        from trl_head_impls import datasets_stand_in

        datasets_stand_in()  # TRL's trainer module imports datasets; the GPU machine has none
        from trl.trainer.distillation_trainer import _chunked_divergence_loss

        def trl(hs, ws, ht, wt, y):
            loss, _entropy_sum, _n = _chunked_divergence_loss(
                hs.unsqueeze(0), ht.unsqueeze(0), ws, wt, (y != -100).unsqueeze(0), beta)
            return loss

        return trl
    if dev != "cuda":
        print(f"skip {impl}: needs CUDA")
        return None
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearJSD

        mod = LigerFusedLinearJSD(jsd_beta=beta)
        return lambda hs, ws, ht, wt, y: mod(hs, ws, ht, wt, y)
    raise ValueError(impl)


# -- measurement ----------------------------------------------------------------------------


def measure(torch, fn, data, ref, args, dev):
    from fused_ce_patch.numerics import relative_error as rel

    hs = data["hs"].detach().requires_grad_()
    ws = data["ws"].detach().requires_grad_()
    ht, wt, y = data["ht"], data["wt"], data["labels"]

    def step():
        out = fn(hs, ws, ht, wt, y)
        out.backward()
        return out

    def reset():
        hs.grad = ws.grad = None

    row = {}
    loss = step()
    row["err_loss"] = rel(loss.detach().float(), ref["loss"])
    row["err_dh"] = rel(hs.grad.float(), ref["dh"])
    row["err_dw"] = rel(ws.grad.float(), ref["dw"])
    reset()
    del loss
    for _ in range(args.warmup):
        step()
        reset()
    if dev == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        torch.cuda.synchronize()
        grads = (hs.numel() + ws.numel()) * 2
        row["extra_mib"] = (torch.cuda.max_memory_allocated() - base - grads) / MiB
        del out
        reset()
    timing = time_ms(step, iters=max(args.iters, 1), device=dev, reset=reset)
    row["ms"], row["ms_min"], row["ms_max"] = timing.median, timing.min, timing.max
    return row


def cleanup(torch, dev):
    import gc

    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


# -- output ---------------------------------------------------------------------------------


def environment(torch, dev):
    import platform
    import subprocess

    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
           "torch": torch.__version__, "device": dev}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if dev == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as exc:
            env["driver"] = f"unknown ({exc})"
    from importlib.metadata import version

    for mod in ("liger-kernel", "trl", "transformers"):
        try:
            env[mod] = version(mod)
        except Exception:
            env[mod] = None
    return env


def fmt_row(r):
    head = f"{r['shape']:<14} beta={r['beta']:<4} {r['impl']:<13}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    parts = [f"{head} {r['ms']:9.2f} ms"]
    if "extra_mib" in r:
        parts.append(f"{r['extra_mib']:9.1f} MiB")
    parts.append(f"loss {r['err_loss']:.1e} dH {r['err_dh']:.1e} dW {r['err_dw']:.1e}")
    return "  ".join(parts)


def print_table(rows):
    print("\n| beta | impl | ms fwd+bwd (median) | extra MiB | err loss | err dH | err dW |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['beta']} | {r['impl']} | error: {r['error'][:80]} | | | | |")
            continue
        x = f"{r['extra_mib']:.0f}" if "extra_mib" in r else ""
        print(f"| {r['beta']} | {r['impl']} | {r['ms']:.1f} | {x} | {r['err_loss']:.1e} | "
              f"{r['err_dh']:.1e} | {r['err_dw']:.1e} |")


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
    import plot_style

    ok = [r for r in rows if "ms" in r]
    betas = list(dict.fromkeys(r["beta"] for r in ok))
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    width = 0.8 / max(len(impls), 1)
    for k, (key, label) in enumerate((("ms", "forward + backward, ms (median)"),
                                      ("extra_mib", "memory beyond inputs and gradients, MiB"))):
        ax = axes[k]
        every = []
        for i, impl in enumerate(impls):
            vals = [next((r.get(key, math.nan) for r in ok
                          if r["beta"] == b and r["impl"] == impl), math.nan) for b in betas]
            every += vals
            ax.bar([j + i * width for j in range(len(betas))], [max(x, 0.1) for x in vals],
                   width, label=plot_style.name(impl), color=plot_style.colour(impl))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(betas))],
                      [f"beta={b}" for b in betas])
        log = plot_style.wants_log_axis(every)
        ax.set_ylabel(label + (" (log scale)" if log else ""))
        if log:
            ax.set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8)
    r0 = ok[0] if ok else {"N": 0, "Hs": 0, "Ht": 0, "V": 0}
    fig.suptitle(f"Generalized JSD from hidden states, bf16, N={r0['N']:,} Hs={r0['Hs']} "
                 f"Ht={r0['Ht']} V={r0['V']:,}; {env.get('gpu', env['device'])}, "
                 f"torch {env['torch']}, triton {env['triton']}")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(os.path.join(args.out, f"{args.tag}.png"), dpi=110)


if __name__ == "__main__":
    main()

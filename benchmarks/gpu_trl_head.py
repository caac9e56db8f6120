"""fused_ce_patch against TRL's fused LM head kernel, at the five loss shapes, on one GPU.

Question: when TRL's trainers (trl >= 1.15) compute with fused_ce_patch instead of their own
``ChunkedLogProbFunction``, what happens to time, memory beyond the gradients, and error?

Implementations (each a ``(hidden, weight, labels) -> loss`` with backward to hidden and
weight; ``labels`` has 10 % ``-100``):
    trl-sft        TRL's kernel as its SFT head calls it: counted rows only (``hidden[mask]``),
                   outputs log_probs, entropy, is_top1 (trl.kernels.ChunkedLogProbFunction,
                   chunk 32768 as in trl.trainer.utils)
    trl-logp       the same with log_probs only (DPO's reference model, GRPO without entropy)
    trl-grpo       trl-sft's outputs with a per-token weight on the log-probabilities (GRPO's
                   advantages, fixed random values in [-1, 1])
    ours-sft       fused_linear_token_stats(entropy=True, accuracy=True) with one
                   ForwardGradHint kept across calls: what the routed TRL head computes for
                   a patched model (backend "triton": gradient formed in forward)
    ours-logp      fused_linear_token_stats, log_probs only, no hint (gradient in backward)
    ours-grpo      ours-sft with trl-grpo's per-token weights (the hint turns itself off in
                   the first warm-up step: gradient in backward)
    ours-sft-tiles ours-sft on the torch-tile algorithm (backend "torch", compiled tile math):
                   the implementation before the Triton row kernel, for comparison
    ours-loss      fused_linear_cross_entropy (backend "auto"): the fused loss of a plain
                   Trainer run, for comparison
The loss is ``-sum(log_probs) / n_counted`` (TRL's SFT loss), weighted per token for *-grpo.

Method: bf16 inputs (hidden ~ N(0, 1), weight ~ N(0, 1/H)), 10 % ignored labels. Time: median
of ``--iters`` fwd+bwd with CUDA events after ``--warmup`` runs. Memory: peak
``torch.cuda.max_memory_allocated`` during one fwd+bwd minus what was allocated before it,
minus the bf16 dH and dW themselves ("extra"). Error: ``||x - ref|| / ||ref||`` of loss, dH,
dW against float32 materialised logits from the same bf16 inputs.

Run (the GPU machine has no network: carry the trl wheel, pure Python, and install it with
``pip install --no-deps trl-1.16.0-py3-none-any.whl``)::

    python benchmarks/gpu_trl_head.py --out $OUT           # H200: table + gpu_trl_head.json
    python benchmarks/gpu_trl_head.py --tiny               # CPU dry run of the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Same inputs, float32 reference and cleanup as the loss-layer benchmark, so rows compare.
from gpu_bench import cleanup, make_inputs, reference  # noqa: E402
from timing import time_ms  # noqa: E402
from trl_head_impls import IMPLS, build, reference_weighted  # noqa: E402

SHAPES = {  # name: (N, H, V, softcap)
    "llama3-8b": (8192, 4096, 128256, None),
    "gemma2-2b": (8192, 2304, 256000, 30.0),
    "qwen2.5-7b": (8192, 3584, 152064, None),
    "llama2-7b": (8192, 4096, 32000, None),
    "gemma3-270m": (32768, 640, 262144, None),
}
TINY = {"tiny": (64, 32, 1003, None), "tiny-softcap": (48, 24, 517, 30.0)}
MiB = 2**20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tiny", action="store_true", help="CPU dry run at tiny shapes")
    args = p.parse_args(argv)
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dev = "cpu" if args.tiny else "cuda"
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("needs CUDA (use --tiny for a CPU dry run)")
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = TINY if args.tiny else {k: SHAPES[k] for k in args.shapes.split(",")}
    env = environment(torch, dev)
    print(json.dumps(env), flush=True)
    rows = []
    for name, (n, h, v, softcap) in shapes.items():
        print(f"\n== {name}: N={n} H={h} V={v} softcap={softcap}", flush=True)
        data = make_inputs(torch, n, h, v, dev)
        impls = args.impls.split(",")
        refs = {False: reference(torch, data, softcap)}
        if any(i.endswith("-grpo") for i in impls):
            refs[True] = reference_weighted(torch, data, softcap)
        for impl in impls:
            ref = refs[impl.endswith("-grpo")]
            t0 = time.time()
            try:
                row = measure(torch, build(torch, impl, softcap), data, ref, args, dev)
            except Exception as exc:  # one failing implementation must not end the run
                traceback.print_exc()
                row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            row.update(shape=name, impl=impl, N=n, H=h, V=v, softcap=softcap,
                       wall_s=round(time.time() - t0, 1))
            rows.append(row)
            print(fmt_row(row), flush=True)
            cleanup(torch, dev)
        del data, ref, refs
        cleanup(torch, dev)
        save(args, env, rows)
    print_table(rows)
    return rows



def measure(torch, fn, data, ref, args, dev):
    hidden = data["hidden"].clone().requires_grad_()
    weight = data["weight"].clone().requires_grad_()
    labels = data["labels"]

    def step():
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, labels)
        loss.backward()
        return loss

    timing = time_ms(step, iters=args.iters, warmup=args.warmup, device=dev)
    hidden.grad = weight.grad = None
    extra = None
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = step()
        torch.cuda.synchronize()
        grads = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
        extra = (torch.cuda.max_memory_allocated() - before - grads) / MiB
    else:
        loss = step()

    def rel(a, b):
        a, b = a.detach().float(), b.float()
        return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()

    return {
        "ms": round(timing.median, 3),
        "extra_mib": None if extra is None else round(extra, 1),
        "err_loss": rel(loss, ref["loss"]),
        "err_dh": rel(hidden.grad, ref["dh"]),
        "err_dw": rel(weight.grad, ref["dw"]),
    }



def environment(torch, dev):
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": dev}
    if dev == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    for pkg in ("trl", "transformers", "triton"):
        try:
            env[pkg] = __import__(pkg).__version__
        except Exception as exc:  # noqa: BLE001 - record why, keep going
            env[pkg] = f"unavailable ({type(exc).__name__})"
    return env


def fmt_row(r):
    if "error" in r:
        return f"{r['shape']:>12} {r['impl']:>10}  ERROR {r['error']}"
    mem = "-" if r["extra_mib"] is None else f"{r['extra_mib']:.0f}"
    return (f"{r['shape']:>12} {r['impl']:>10} {r['ms']:>9.2f} ms {mem:>8} MiB  "
            f"loss {r['err_loss']:.1e}  dH {r['err_dh']:.1e}  dW {r['err_dw']:.1e}")


def print_table(rows):
    print("\n| shape | impl | ms | extra MiB | err loss | err dH | err dW |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['impl']} | error: {r['error'][:60]} | | | | |")
            continue
        mem = "-" if r["extra_mib"] is None else f"{r['extra_mib']:.0f}"
        print(f"| {r['shape']} | {r['impl']} | {r['ms']:.2f} | {mem} | {r['err_loss']:.1e} | "
              f"{r['err_dh']:.1e} | {r['err_dw']:.1e} |")


def save(args, env, rows):
    os.makedirs(args.out, exist_ok=True)
    name = "gpu_trl_head_tiny.json" if args.tiny else "gpu_trl_head.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    plot(rows, os.path.join(args.out, name.replace(".json", ".png")))


def plot(rows, path):
    """Bars of ours / TRL's time and extra memory per shape and head (sft, logp, grpo), with
    the issue's 0.80x time target."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    import plot_style

    got = {(r["shape"], r["impl"]): r for r in rows if "ms" in r}
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    heads = [h for h in ("sft", "logp", "grpo")
             if any((s, f"ours-{h}") in got and (s, f"trl-{h}") in got for s in shapes)]
    if not heads:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(heads)
    shades = {"sft": plot_style.OURS, "logp": "#6a9fd8", "grpo": "#0b2f5c"}
    for k, (key, label) in enumerate((("ms", "time, ours / TRL"),
                                      ("extra_mib", "extra memory, ours / TRL"))):
        ax = axes[k]
        for i, h in enumerate(heads):
            xs, ys = [], []
            for j, s in enumerate(shapes):
                ours, trl = got.get((s, f"ours-{h}")), got.get((s, f"trl-{h}"))
                if ours and trl and ours.get(key) and trl.get(key):
                    xs.append(j + i * width)
                    ys.append(ours[key] / trl[key])
            ax.bar(xs, ys, width, label=h, color=shades[h])
        ax.axhline(1.0, color="#8c8c8c", lw=0.8)
        if key == "ms":
            ax.axhline(0.8, color="#d62728", lw=0.8, ls="--", label="target 0.80")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("fused_linear_token_stats vs TRL's fused LM head (fwd+bwd)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

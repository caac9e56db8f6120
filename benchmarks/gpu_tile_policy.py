"""GPU: does the tile policy (fused_ce_patch.tile_policy) change the speed of the routed TRL head?

Question: ``fused_linear_token_stats`` with ``logits_budget=None`` now caps the loss's default
chunk at TRL's own tile (``[min(M, 4096), min(V, 32768)]`` in the compute dtype). At
``gpu_trl_head.py``'s five shapes, what does that cost in time, and what does it save?

For each shape the script first compares the two budgets: the loss's default
(``backends.triton.memory_first_budget(M)``, the default before the policy) and the policy's
(``tile_policy.logits_budget(M, V, dtype, TRL_LOGPROB, default)``, the default now). Where they
are equal nothing changes and nothing is timed. Where they differ, it times both, in the same
process, alternating: bf16 inputs, 10 % ignored labels, SFT (log-probs + entropy + top-1,
mean loss, one ``ForwardGradHint``) and GRPO (the same with fixed per-token weights in
[-1, 1]); median of ``--iters`` fwd+bwd (CUDA events) after ``--warmup``; peak
``max_memory_allocated`` of one step above what was allocated before it.

Usage::

    python benchmarks/gpu_tile_policy.py --out $OUT     # H200: table, JSON and PNG
    python benchmarks/gpu_tile_policy.py --tiny         # CPU dry run of the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {  # name: (N, H, V), as benchmarks/gpu_trl_head.py
    "llama3-8b": (8192, 4096, 128256),
    "gemma2-2b": (8192, 2304, 256000),
    "qwen2.5-7b": (8192, 3584, 152064),
    "llama2-7b": (8192, 4096, 32000),
    "gemma3-270m": (32768, 640, 262144),
}
TINY = {"tiny-wide": (96, 16, 40000)}
MiB = 2**20


def budgets(torch, m, v, dtype):
    """``(old default, policy default)`` in bytes for ``m`` counted rows."""
    from fused_ce_patch import tile_policy
    from fused_ce_patch.backends.triton import memory_first_budget

    old = memory_first_budget(m)
    return old, tile_policy.logits_budget(m, v, dtype, tile_policy.TRL_LOGPROB, old)


def measure(torch, n, h, v, budget, grpo, args, dev):
    from fused_ce_patch import ForwardGradHint, fused_linear_token_stats

    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16
    hidden = torch.randn(n, h, generator=g, device=dev).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, device=dev) * h**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g, device=dev)
    labels[torch.rand(n, generator=g, device=dev) < 0.1] = -100
    m = int((labels != -100).sum())
    weights = torch.rand(n, generator=g, device=dev) * 2 - 1
    hint = ForwardGradHint()

    def step():
        hidden.grad = weight.grad = None
        s = fused_linear_token_stats(hidden, weight, labels, entropy=True, accuracy=True,
                                     grad_hint=hint, logits_budget=budget)
        lp = s.log_probs * weights if grpo else s.log_probs
        (-lp.sum() / m).backward()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.iters):
        if dev == "cuda":
            a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = None
    if dev == "cuda":
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / MiB
    return statistics.median(times), peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    import torch

    dev = "cpu" if args.tiny else "cuda"
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("needs CUDA (use --tiny for a CPU dry run)")
    shapes = TINY if args.tiny else SHAPES
    env = {"torch": torch.__version__, "device": dev,
           "gpu": torch.cuda.get_device_name() if dev == "cuda" else None}
    rows = []
    for name, (n, h, v) in shapes.items():
        m = round(n * 0.9)  # about the counted rows; the step uses the exact count
        old, new = budgets(torch, m, v, torch.bfloat16)
        row = {"shape": name, "N": n, "H": h, "V": v, "old_mib": old / MiB,
               "policy_mib": new / MiB}
        if new < old:
            for task in ("sft", "grpo"):
                for label, budget in (("old", old), ("policy", new)):
                    ms, peak = measure(torch, n, h, v, budget, task == "grpo", args, dev)
                    row[f"{task}_{label}_ms"], row[f"{task}_{label}_peak_mib"] = ms, peak
        rows.append(row)
        print(json.dumps(row), flush=True)
    print_table(rows)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "gpu_tile_policy" + ("_tiny" if args.tiny else ""))
    with open(stem + ".json", "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    plot(rows, stem + ".png")


def print_table(rows):
    print("\n| shape | chunk MiB: old / policy | SFT ms: old / policy | GRPO ms: old / policy |")
    print("|---|---|---|---|")
    for r in rows:
        if "sft_old_ms" not in r:
            print(f"| {r['shape']} | {r['old_mib']:.0f} / {r['policy_mib']:.0f} | unchanged "
                  f"| unchanged |")
            continue
        print(f"| {r['shape']} | {r['old_mib']:.0f} / {r['policy_mib']:.0f} | "
              f"{r['sft_old_ms']:.2f} / {r['sft_policy_ms']:.2f} | "
              f"{r['grpo_old_ms']:.2f} / {r['grpo_policy_ms']:.2f} |")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "sft_old_ms" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(timed):
        for j, (key, label) in enumerate((("sft_old_ms", "SFT, old default"),
                                          ("sft_policy_ms", "SFT, policy"),
                                          ("grpo_old_ms", "GRPO, old default"),
                                          ("grpo_policy_ms", "GRPO, policy"))):
            ax.bar(i + j * 0.2, r[key], 0.2, label=label if i == 0 else None,
                   color=f"C{j}")
    ax.set_xticks([i + 0.3 for i in range(len(timed))])
    ax.set_xticklabels([r["shape"] for r in timed])
    ax.set_ylabel("fwd+bwd ms (median)")
    ax.set_title("tile policy on the GPU: shapes whose chunk changes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

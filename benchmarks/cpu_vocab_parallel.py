"""CPU benchmark: peak memory per rank of a tensor-parallel lm_head's loss, stock vs
vocabulary-parallel fused, on 2 gloo processes.

Question: with the lm_head weight split along the vocabulary over 2 ranks, how much memory
does one training step of the loss take on each rank, and does the fused loss follow
``logits_budget`` rather than ``tokens x vocab``?

    stock:  transformers' ``colwise_gather_output`` head (the layout ``tp_plan="auto"`` gives
            ``lm_head``): local logits [N, V/2], all-gathered to [N, V] on every rank, then
            ``F.cross_entropy`` and its backward
    fused:  ``vocab_parallel_linear_cross_entropy`` on the local shard at several budgets

Each configuration runs in 2 fresh processes (so one's freed memory cannot hide the other's
peak). In each rank: inputs are built (hidden ``[N, H]`` replicated, the rank's weight shard,
labels), one warm-up step runs, gradients are dropped, the kernel's peak-RSS mark is reset
(``/proc/self/clear_refs``) and ``VmRSS`` read; then one timed forward+backward step; **peak
extra memory** = ``VmHWM - VmRSS`` before the step (it includes the returned gradients:
``dH`` [N, H] and the weight shard's gradient, the same for both). glibc serves allocations
above 64 KiB with ``mmap`` so freed buffers leave the resident set at once. The loss of every
configuration is compared with stock's (relative error).

Usage::

    python benchmarks/cpu_vocab_parallel.py           # N=2048, H=256, V=32768, 2 ranks

Writes ``benchmarks/results/cpu_vocab_parallel.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_ms  # noqa: E402  (the timer of every benchmark)

from fused_ce_patch.demo.memory import current_rss, peak_rss, reset_peak  # noqa: E402

SIZE = dict(n=2048, h=256, v=32768)
WORLD = 2
#: (name, logits_budget); None for stock and for the fused loss's default budget
CONFIGS = (("stock", None), ("fused 1 MiB", 2**20), ("fused 8 MiB", 8 * 2**20),
           ("fused 64 MiB", 64 * 2**20), ("fused default", None))
RESULTS = Path(__file__).resolve().parent / "results"


def _rank(rank, config, size, init, out):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    name, budget = config
    n, h, v = size["n"], size["h"], size["v"]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).requires_grad_(True)
    weight = torch.randn(v, h, generator=g) * h**-0.5
    labels = torch.randint(0, v, (n,), generator=g)
    per = -(-v // WORLD)
    start, stop = rank * per, min(v, (rank + 1) * per)

    if name == "stock":
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

        head = nn.Linear(h, v, bias=False)
        with torch.no_grad():
            head.weight.copy_(weight)
        style = ALL_PARALLEL_STYLES["colwise_gather_output"]
        mesh = init_device_mesh("cpu", (WORLD,))
        style.shard_param(head, "weight", mesh)
        style.install_forward(head, mesh)
        param = head.weight

        def step():
            loss = F.cross_entropy(head(hidden), labels)
            loss.backward()
            return loss
    else:
        from fused_ce_patch.vocab_parallel import vocab_parallel_linear_cross_entropy

        param = weight[start:stop].clone().requires_grad_(True)

        def step():
            loss = vocab_parallel_linear_cross_entropy(
                hidden, param, labels, vocab_start=start, vocab_size=v, logits_budget=budget)
            loss.backward()
            return loss

    del weight
    step()  # warm-up
    hidden.grad = param.grad = None
    gc.collect()
    exact = reset_peak()
    base = current_rss()
    losses = []
    timing = time_ms(lambda: losses.append(step()), iters=1)
    loss, elapsed = losses[0], timing.ms[0] / 1e3
    peak = peak_rss()
    result = {"config": name, "budget": budget, "rank": rank, "time_s": elapsed,
              "peak_extra_bytes": peak - base, "peak_reset_exact": exact,
              "loss": loss.item(), "shard": stop - start,
              "grads_bytes": (n * h + (stop - start) * h) * 4}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _run(config, size):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(config, size, os.path.join(tmp, "init"), tmp), nprocs=WORLD)
        return [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(WORLD)]


def _table(rows, size):
    stock = rows[0]
    lines = [
        f"N={size['n']}, H={size['h']}, V={size['v']}, float32, {WORLD} ranks (gloo, 1 thread "
        f"each); per rank: logits shard [N, V/{WORLD}] = "
        f"{size['n'] * size['v'] // WORLD * 4 / 2**20:.0f} MiB, gathered [N, V] = "
        f"{size['n'] * size['v'] * 4 / 2**20:.0f} MiB\n",
        "| implementation | logits_budget (MiB) | step time (s, max over ranks) "
        "| peak extra memory per rank (MiB, max) | vs stock | loss rel. error vs stock |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = "-" if r["budget"] is None else f"{r['budget'] / 2**20:.0f}"
        if r["config"] == "fused default":
            budget = "192 (default)"
        err = abs(r["loss"] - stock["loss"]) / abs(stock["loss"])
        lines.append(
            f"| {r['config']} | {budget} | {r['time_s']:.2f} | {r['peak_extra_bytes'] / 2**20:.0f} "
            f"| {r['peak_extra_bytes'] / stock['peak_extra_bytes']:.3f}x | {err:.1e} |"
        )
    lines.append(
        f"\nPeak extra memory includes the gradients each rank returns (dH and its dW shard: "
        f"{rows[0]['grads_bytes'] / 2**20:.0f} MiB)."
    )
    return "\n".join(lines)


def _plot(rows, size, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    mib = [r["peak_extra_bytes"] / 2**20 for r in rows]
    colours = ["#8c8c8c"] + ["#1f5fa8"] * (len(rows) - 1)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(range(len(rows)), mib, color=colours)
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    ax.set_ylabel("peak extra memory per rank (MiB)")
    ax.axhline(size["n"] * size["v"] * 4 / 2**20, color="#d62728", lw=1, ls="--",
               label="[tokens, vocab] float32 logits")
    ax.legend(fontsize=8)
    fig.suptitle(f"CPU, 2 ranks, float32, {size['n']:,} tokens x vocabulary {size['v']:,} "
                 f"(H={size['h']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by the spawned processes
    os.environ["OMP_NUM_THREADS"] = "1"
    rows = []
    for config in CONFIGS:
        print(f"{config[0]} ...", file=sys.stderr, flush=True)
        ranks = _run(config, SIZE)
        row = dict(ranks[0])
        row["time_s"] = max(r["time_s"] for r in ranks)
        row["peak_extra_bytes"] = max(r["peak_extra_bytes"] for r in ranks)
        row["ranks"] = ranks
        rows.append(row)
    import torch

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "nproc": os.cpu_count(),
            "loadavg": os.getloadavg()}
    table = _table(rows, SIZE)
    print(table)
    print(f"\n{meta['date']} | torch {meta['torch']} | nproc={meta['nproc']} | load average "
          f"{meta['loadavg'][0]:.1f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "cpu_vocab_parallel.json"
    out.write_text(json.dumps({"size": SIZE, "world": WORLD, "meta": meta, "results": rows},
                              indent=1))
    _plot(rows, SIZE, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()

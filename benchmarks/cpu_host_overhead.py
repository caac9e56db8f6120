"""Host time of the patch's per-call checks and routing, on CPU.

Question (issue 39, item 3): how much host time does a patched training forward spend beyond
the work it must do anyway — the decoder and one fused loss call? Method: a tiny Llama
(1 layer, H 16, V 64, 2 x 16 tokens), so device work is negligible and every microsecond is
host time; per call the CPU time of this thread (``time.thread_time``, unaffected by other
processes on the machine), median over ``--calls`` calls after a warm-up, the best median of
``--repeats`` rounds. Rows:

    stock            the unpatched model's forward with labels (HF's loss)
    by-hand          ``model.model(...)`` then ``fused_linear_cross_entropy(..., shift=True)``
    patched          the patched model's forward with labels
    checks+routing   patched - by-hand: what the patch adds around the loss call
    paired           the same difference measured pairwise: each by-hand call next to a patched
                     call (in alternating order), the median of the per-pair differences over
                     ``--calls`` pairs, median over ``--repeats`` rounds; slow changes in the
                     machine's load shift both calls of a pair alike, so this row varies less
                     from run to run than the difference of the two rows above

Prints the table, writes ``cpu_host_overhead.json`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from fused_ce_patch import apply_fused_ce, fused_linear_cross_entropy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    stock = LlamaForCausalLM(cfg).train()
    fused = LlamaForCausalLM(cfg).train()
    fused.load_state_dict(stock.state_dict())
    apply_fused_ce(fused)
    ids = torch.randint(0, 64, (2, 16))

    calls = {
        "stock": lambda: stock(input_ids=ids, labels=ids).loss,
        "by-hand": lambda: fused_linear_cross_entropy(
            fused.model(input_ids=ids).last_hidden_state, fused.lm_head.weight, ids,
            shift=True),
        "patched": lambda: fused(input_ids=ids, labels=ids).loss,
    }

    def median_ms(fn):
        for _ in range(30):
            fn()
        times = []
        for _ in range(args.calls):
            t0 = time.thread_time()
            fn()
            times.append(time.thread_time() - t0)
        return statistics.median(times) * 1e3

    def paired_ms(by_hand, patched):
        for _ in range(30):
            by_hand()
            patched()
        diffs = []
        for i in range(args.calls):
            first, second = (by_hand, patched) if i % 2 else (patched, by_hand)
            t0 = time.thread_time()
            first()
            t1 = time.thread_time()
            second()
            t2 = time.thread_time()
            took = {first: t1 - t0, second: t2 - t1}
            diffs.append(took[patched] - took[by_hand])
        return statistics.median(diffs) * 1e3

    best = {name: min(median_ms(fn) for _ in range(args.repeats)) for name, fn in calls.items()}
    best["checks+routing"] = best["patched"] - best["by-hand"]
    best["paired"] = statistics.median(paired_ms(calls["by-hand"], calls["patched"])
                                       for _ in range(args.repeats))
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cpu": platform.processor() or
           platform.machine(), "calls": args.calls, "repeats": args.repeats}
    print(json.dumps(env))
    print("| row | host ms per forward |\n|---|---|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.3f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu_host_overhead.json"), "w") as f:
        json.dump({"env": env, "ms": best}, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(list(best), list(best.values()), color=["#888888", "#6a9fd8", "#1f5fa8", "#d62728", "#ff9896"])
    ax.set_xlabel("host CPU ms per training forward (median)")
    ax.set_title(f"Patch host overhead, tiny Llama, torch {torch.__version__}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "cpu_host_overhead.png"), dpi=120)


if __name__ == "__main__":
    main()

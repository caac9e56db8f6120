"""Stock and fused training steps interleaved in one process (ABBA blocks), eager or compiled.

Question (issue 39, item 2): is the patched step at most the stock step at small batches?
``gpu_compile.py`` runs one variant after the other, and on a shared host the same variant
drifts by more than the difference (45.0 and 51.5 ms in one run, 2026-12-05). Here both models
stay loaded and alternate in blocks of ``--steps`` steps, ``stock, fused, fused, stock, ...``,
after each has compiled during its warm-up; the result per arm is the median of its block
medians, with the ratio fused / stock per pair of neighbouring blocks.

Model: ``--config`` from ``benchmarks/e2e_configs/`` with seeded random bf16 weights (float32
on CPU), sdpa attention, fused AdamW; batch ``--batch`` x ``--seq``, the first 1/16 of each
sequence ignored (as ``gpu_compile.py``). Memory is not reported (both models are resident):
``gpu_compile.py`` gives each variant's peak on its own. ``--tiny`` is a CPU dry run (2 layers,
short sequences, backend ``torch``).

Prints a table and writes ``gpu_compile_ab_<config>_<batch>x<seq>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import time_ms  # noqa: E402  (the timer of every benchmark)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    p.add_argument("--config", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--modes", default="compiled,eager")
    p.add_argument("--blocks", type=int, default=6, help="blocks per arm")
    p.add_argument("--steps", type=int, default=8, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per arm (compiles)")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    if args.tiny:
        args.batch, args.seq, args.blocks, args.steps, args.warmup = 1, 32, 2, 1, 1
    sys.path.insert(0, os.path.dirname(HERE))
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from fused_ce_patch import apply_fused_ce

    dev = "cpu" if args.tiny else "cuda"
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
           "transformers": transformers.__version__, "config": args.config,
           "batch": args.batch, "seq": args.seq, "blocks": args.blocks, "steps": args.steps}
    if dev == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(env), flush=True)
    config = AutoConfig.from_pretrained(os.path.join(HERE, "e2e_configs", args.config + ".json"))
    if args.tiny:
        config.num_hidden_layers = 2
    g = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=dev, generator=g)
    labels = ids.clone()
    labels[:, : args.seq // 16] = -100
    rows = []
    for mode in args.modes.split(","):
        torch._dynamo.reset()
        steps = {}
        for arm in ("stock", "fused"):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32 if args.tiny else torch.bfloat16,
                attn_implementation="sdpa").to(dev).train()
            if arm == "fused":
                apply_fused_ce(model, backend="torch" if args.tiny else "auto")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev == "cuda")
            run = torch.compile(model) if mode == "compiled" else model

            def step(run=run, opt=opt):
                out = run(input_ids=ids, labels=labels)
                out.loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            time_ms(step, iters=1, warmup=args.warmup, device=dev)  # compiles here
            steps[arm] = step
        blocks = {"stock": [], "fused": []}
        for b in range(args.blocks):
            for arm in (("stock", "fused") if b % 2 == 0 else ("fused", "stock")):
                blocks[arm].append(time_ms(steps[arm], iters=args.steps, device=dev).median)
        ratios = [f / s for f, s in zip(blocks["fused"], blocks["stock"])]
        row = {"mode": mode, "stock_ms": statistics.median(blocks["stock"]),
               "fused_ms": statistics.median(blocks["fused"]),
               "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
               "ratio_max": max(ratios), "stock_blocks": blocks["stock"],
               "fused_blocks": blocks["fused"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del steps
        if dev == "cuda":
            torch.cuda.empty_cache()
    print("\n| mode | stock ms | fused ms | fused / stock (median of block pairs) | range |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['stock_ms']:.1f} | {r['fused_ms']:.1f} | "
              f"{r['ratio_median']:.3f} | {r['ratio_min']:.3f}–{r['ratio_max']:.3f} |")
    os.makedirs(args.out, exist_ok=True)
    name = f"gpu_compile_ab_{args.config}_{args.batch}x{args.seq}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

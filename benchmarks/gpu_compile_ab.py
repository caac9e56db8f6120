"""Stock and fused training steps interleaved in one process (ABBA blocks), eager or compiled.

Question (issue 39, item 2): is the patched step at most the stock step at small batches?
``gpu_compile.py`` runs one variant after the other, and on a shared host the same variant
drifts by more than the difference (45.0 and 51.5 ms in one run, 2026-12-05). Here both models
stay loaded and alternate in blocks of ``--steps`` steps, ``stock, fused, fused, stock, ...``,
after each has compiled during its warm-up; the result per arm is the median of its block
medians, with the ratio fused / stock per pair of neighbouring blocks.

Model: ``--config`` from ``benchmarks/e2e_configs/`` with seeded random bf16 weights (float32 on
CPU), sdpa attention, fused AdamW; batch ``--batch`` x ``--seq``, the first 1/16 of each
sequence ignored (as ``gpu_compile.py``). Memory per arm, on a GPU: its resident state (weights
and AdamW moments; gradients are freed after each step) plus the most its timed steps allocated
above what was allocated when they started, i.e. its peak as if it ran alone (the other model's
resident state is left out). Graph breaks: Dynamo's count while the arm compiles. ``--trace``:
after the blocks, ``torch.profiler`` over ``--steps`` more steps of each arm, to say where a
difference goes: per step, the time some kernel runs (``busy``) and the time none does
(``idle``: host work, syncs, launch latency), the kernels by total time, and the longest idle
gaps with the host ops that overlap them. ``--stock-sync``: a third arm, stock with one host
read of its loss between forward and backward (what a host read mid-step costs stock; the
fused loss makes one, for its labels). ``--tiny`` is a CPU dry run (2 layers, short
sequences, backend ``torch``; the trace then has no kernels).

Prints a table and writes ``gpu_compile_ab_<config>_<batch>x<seq><tag>.json`` under ``--out``.
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    p.add_argument("--config", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--modes", default="compiled,eager")
    p.add_argument("--blocks", type=int, default=6, help="blocks per arm")
    p.add_argument("--steps", type=int, default=8, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per arm (compiles)")
    p.add_argument("--tag", default="", help="appended to the JSON's name")
    p.add_argument("--trace", action="store_true", help="profile each arm after its blocks")
    p.add_argument("--stock-sync", action="store_true",
                   help="a third arm: stock with one host read of its loss before backward")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
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
        steps, resident, breaks = {}, {}, {}
        arms = ("stock", "fused") + (("stock_sync",) if args.stock_sync else ())
        for arm in arms:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32 if args.tiny else torch.bfloat16,
                attn_implementation="sdpa").to(dev).train()
            if arm == "fused":
                apply_fused_ce(model, backend="torch" if args.tiny else "auto")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev == "cuda")
            run = torch.compile(model) if mode == "compiled" else model

            def step(run=run, opt=opt, sync=arm == "stock_sync"):
                out = run(input_ids=ids, labels=labels)
                if sync:  # the host waits for the forward, as a loss's host read would
                    out.loss.item()
                out.loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            torch._dynamo.utils.counters.clear()
            time_ms(step, iters=1, warmup=args.warmup, device=dev)  # compiles here
            breaks[arm] = sum(torch._dynamo.utils.counters["graph_break"].values())
            steps[arm] = step
            state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
            resident[arm] = sum(t.untyped_storage().nbytes()
                                for t in list(model.parameters()) + state)
        blocks = {arm: [] for arm in arms}
        above = {arm: 0 for arm in arms}
        for b in range(args.blocks):
            for arm in (arms if b % 2 == 0 else arms[::-1]):
                if dev == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    start = torch.cuda.memory_allocated()
                blocks[arm].append(time_ms(steps[arm], iters=args.steps, device=dev).median)
                if dev == "cuda":
                    above[arm] = max(above[arm], torch.cuda.max_memory_allocated() - start)
        peak = {a: (resident[a] + above[a]) / 2**30 for a in blocks} if dev == "cuda" else {}
        traced = ({arm: trace(torch, steps[arm], args.steps, dev) for arm in steps}
                  if args.trace else None)
        def over_stock(arm):  # the arm's time / stock's, per pair of neighbouring blocks
            return [a / s for a, s in zip(blocks[arm], blocks["stock"])]

        ratios = over_stock("fused")
        row = {"mode": mode, "stock_ms": statistics.median(blocks["stock"]),
               "fused_ms": statistics.median(blocks["fused"]),
               "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
               "ratio_max": max(ratios), "stock_peak_gib": peak.get("stock"),
               "fused_peak_gib": peak.get("fused"), "stock_graph_breaks": breaks["stock"],
               "fused_graph_breaks": breaks["fused"], "trace": traced,
               "stock_blocks": blocks["stock"], "fused_blocks": blocks["fused"]}
        if args.stock_sync:
            row["stock_sync_blocks"] = blocks["stock_sync"]
            row["stock_sync_ratio_median"] = statistics.median(over_stock("stock_sync"))
            row["stock_sync_peak_gib"] = peak.get("stock_sync")
        rows.append(row)
        print(json.dumps(row), flush=True)
        del steps
        if dev == "cuda":
            torch.cuda.empty_cache()
    print("\n| mode | stock ms | fused ms | fused / stock (median of block pairs) | range "
          "| peak GiB stock / fused | graph breaks stock / fused |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mem = (f"{r['stock_peak_gib']:.2f} / {r['fused_peak_gib']:.2f}"
               if r["stock_peak_gib"] is not None else "-")
        print(f"| {r['mode']} | {r['stock_ms']:.1f} | {r['fused_ms']:.1f} | "
              f"{r['ratio_median']:.3f} | {r['ratio_min']:.3f}–{r['ratio_max']:.3f} | {mem} | "
              f"{r['stock_graph_breaks']} / {r['fused_graph_breaks']} |")
    for r in rows:
        if "stock_sync_ratio_median" in r:
            print(f"{r['mode']}: stock with a host read before backward / stock "
                  f"{r['stock_sync_ratio_median']:.3f}")
    for r in rows:
        if r["trace"]:
            print_trace(r["mode"], r["trace"])
    os.makedirs(args.out, exist_ok=True)
    name = f"gpu_compile_ab_{args.config}_{args.batch}x{args.seq}{args.tag}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    return rows


def trace(torch, step, steps, dev, top=15, min_gap_us=20.0):
    """``steps`` profiled calls of ``step``: per step, the ms in which some kernel runs (kernel
    intervals merged) and the rest of the traced time (``idle``; from the first host op to the
    last event's end), the ``top`` kernels by time per step, and the ``top`` longest idle gaps
    (over ``min_gap_us``) with the host ops overlapping each."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    if dev == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if dev == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                 if e.device_type == DeviceType.CUDA)  # fmt: skip
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == DeviceType.CPU]  # fmt: skip
    t0 = min(s for s, _, _ in host)
    end = max([e for _, e, _ in gpu] + [e for _, e, _ in host])
    busy, gaps, until, last = 0.0, [], t0, "(start)"
    for s, e, name in gpu:
        if s - until > min_gap_us:
            gaps.append((until, s, last, name))
        if e > until:
            busy += e - max(s, until)
            until, last = e, name
    kernels = {}
    for s, e, name in gpu:
        kernels[name] = kernels.get(name, 0.0) + (e - s)
    rows = []
    for s, e, before, after in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        over = sorted(((min(he, e) - max(hs, s), hn) for hs, he, hn in host if hs < e and he > s),
                      reverse=True)[:4]  # fmt: skip
        rows.append({"us": e - s, "before": before[:60], "after": after[:60],
                     "host": [f"{hn[:50]} {d:.0f}us" for d, hn in over]})  # fmt: skip
    per = 1e3 * steps
    return {"step_ms": (end - t0) / per, "busy_ms": busy / per, "idle_ms": (end - t0 - busy) / per,
            "kernels": sorted(((n[:110], t / per) for n, t in kernels.items()),
                              key=lambda k: -k[1])[:top],
            "gaps": rows}


def print_trace(mode, traced):
    for arm, t in traced.items():
        print(f"\n{mode} {arm}: traced step {t['step_ms']:.2f} ms, kernels busy "
              f"{t['busy_ms']:.2f} ms, idle {t['idle_ms']:.2f} ms per step")
        for name, ms in t["kernels"]:
            print(f"  {ms:8.3f} ms  {name}")
        for g in t["gaps"][:8]:
            print(f"  idle {g['us']:7.0f} us  {g['before']} -> {g['after']}; host: "
                  f"{'; '.join(g['host'])}")


if __name__ == "__main__":
    main()

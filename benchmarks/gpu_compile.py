"""torch.compile vs eager: one training step of a small causal LM's architecture on one GPU.

Question: does ``torch.compile(model)`` on a model patched with ``apply_fused_ce`` run (the
fused loss is the opaque custom op ``fused_ce::linear_cross_entropy``), give the eager loss, and
how does its step time compare with eager, with the stock (unpatched) model as a yardstick?

Model: ``--config``, an architecture of ``benchmarks/e2e_configs/`` (default SmolLM2-135M's,
``smollm2-135m``; ``gemma3-270m`` for Gemma-3-270M's) with seeded random bf16 weights; batch ``--batch`` x ``--seq`` tokens, the first 1/16 of each
sequence ignored, fused AdamW. Variants: ``stock``/``fused`` x ``eager``/``compiled``
(Inductor, default mode). Compilation happens in the first (untimed) steps.

Prints one JSON line per variant and a table (median step ms over ``--steps`` after
``--warmup``, peak GiB allocated during the timed steps, first loss, graph breaks counted by
Dynamo), and writes ``gpu_compile_<config>_<batch>x<seq>.json`` under ``--out``. ``--tiny`` is a CPU dry run (2
layers, short sequences, ``torch`` backend).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import time_ms  # noqa: E402  (the timer of every benchmark)

VARIANTS = ("stock-eager", "stock-compiled", "fused-eager", "fused-compiled")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--config", default="smollm2-135m",
                   help="architecture: a file name in benchmarks/e2e_configs/ without .json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile one more step: kernel time, device idle "
                        "time and the top kernels, in profile_<variant>.txt and a Chrome trace")
    args = p.parse_args()
    if args.tiny:
        args.batch, args.seq, args.steps, args.warmup = 1, 32, 1, 1
    sys.path.insert(0, os.path.dirname(HERE))
    import torch
    import transformers

    dev = "cpu" if args.tiny else "cuda"
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
           "transformers": transformers.__version__, "config": args.config,
           "batch": args.batch, "seq": args.seq}
    if dev == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(env), flush=True)
    rows = []
    for variant in args.variants.split(","):
        t0 = time.time()
        try:
            row = run_one(torch, variant, args, dev)
        except Exception as exc:
            traceback.print_exc()
            row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        row.update(variant=variant, wall_s=round(time.time() - t0, 1))
        rows.append(row)
        print(json.dumps(row), flush=True)
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    print("\n| variant | step ms (median) | peak GiB | first loss | graph breaks |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['error']} | | | |")
        else:
            print(f"| {r['variant']} | {r['ms']:.1f} | {r['peak_gib']:.2f} | {r['loss']:.4f} | "
                  f"{r['graph_breaks']} |")
    if any("prof_wall_ms" in r for r in rows):
        print("\n| variant | profiled step ms | kernel ms (sum) | device busy ms | idle inside span ms |")
        print("|---|---|---|---|---|")
        for r in rows:
            if "prof_wall_ms" in r:
                print(f"| {r['variant']} | {r['prof_wall_ms']} | {r['prof_kernel_ms']} | "
                      f"{r['prof_busy_ms']} | {r['prof_idle_in_span_ms']} |")
    os.makedirs(args.out, exist_ok=True)
    name = f"gpu_compile_{args.config}_{args.batch}x{args.seq}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


def run_one(torch, variant, args, dev):
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, mode = variant.split("-")
    config = AutoConfig.from_pretrained(os.path.join(HERE, "e2e_configs", args.config + ".json"))
    if args.tiny:
        config.num_hidden_layers = 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                             attn_implementation="sdpa").to(dev).train()
    if kind == "fused":
        from fused_ce_patch import apply_fused_ce

        apply_fused_ce(model, backend="torch" if args.tiny else "auto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev == "cuda")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run = torch.compile(model) if mode == "compiled" else model
    g = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=dev, generator=g)
    labels = ids.clone()
    labels[:, : args.seq // 16] = -100

    def step():
        out = run(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    first = float(step())
    timing = time_ms(step, iters=args.steps, warmup=args.warmup, device=dev, track_peak=True)
    times = timing.ms
    peak = timing.peak_bytes / 2**30 if dev == "cuda" else 0.0
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    row = {"ms": timing.median, "ms_all": times, "peak_gib": peak, "loss": first,
           "graph_breaks": breaks}
    if args.profile:
        row.update(profile_step(torch, step, variant, args.out, dev))
    del model, opt, run
    return row


def profile_step(torch, step, variant, out, dev):
    """One step under ``torch.profiler``: is a gap kernel time or time the device sits idle?

    Returns the step's wall ms, the summed kernel ms and the device's idle ms (wall minus the
    union of kernel intervals); writes the top kernels by device time to profile_<variant>.txt
    and the trace to profile_<variant>.json.gz (chrome://tracing, Perfetto).
    """
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    step()  # leave the profiler's own first-call cost out
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        if dev == "cuda":
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy = 0.0
    kernel_sum = sum(b - a for a, b in spans) / 1e3
    cur_a = cur_b = None
    for a, b in spans:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        busy += cur_b - cur_a
    first = spans[0][0] if spans else 0
    last = max((b for _, b in spans), default=0)
    os.makedirs(out, exist_ok=True)
    sort = "self_cuda_time_total" if dev == "cuda" else "self_cpu_time_total"
    with open(os.path.join(out, f"profile_{variant}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=90))
        f.write("\n\nBy total (self + children) time: which ops the kernels ran under\n")
        f.write(prof.key_averages().table(sort_by=sort.replace("self_", ""), row_limit=30,
                                          max_name_column_width=90))
    prof.export_chrome_trace(os.path.join(out, f"profile_{variant}.json"))
    import gzip
    import shutil

    with open(os.path.join(out, f"profile_{variant}.json"), "rb") as src, \
            gzip.open(os.path.join(out, f"profile_{variant}.json.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(os.path.join(out, f"profile_{variant}.json"))
    return {"prof_wall_ms": round(wall, 2), "prof_kernel_ms": round(kernel_sum, 2),
            "prof_busy_ms": round(busy / 1e3, 2),
            "prof_idle_in_span_ms": round((last - first - busy) / 1e3, 2)}


if __name__ == "__main__":
    main()

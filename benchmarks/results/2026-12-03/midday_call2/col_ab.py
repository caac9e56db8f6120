"""Column-tiled recompute backward vs row chunks for the per-token heads without a hint
(logp: log-probs only; grpo: per-token weights), TRL 1.16's heads beside, one process.
Variants alternated twice; gpu_trl_head.measure (median of --iters, extra MiB, errors vs fp32)."""
import argparse, json, os, sys, time
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_bench, gpu_trl_head
from trl_head_impls import build, reference_weighted
from fused_ce_patch.backends.triton import token_stats as ts

real_plan = ts.plan_columns
VARIANTS = {"rows": dict(plan=False), "cols8k": dict(plan=True, group=8192),
            "cols4k": dict(plan=True, group=4096)}
def setv(v):
    ts.plan_columns = real_plan if v["plan"] else (lambda *a: None)
    ts.COL_GROUP_ROWS = v.get("group", 8192)

args = argparse.Namespace(iters=10, warmup=3)
torch.backends.cuda.matmul.allow_tf32 = False
out = {}
shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else list(gpu_trl_head.SHAPES)
for name in shapes:
    n, H, V, cap = gpu_trl_head.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    refs = {False: gpu_bench.reference(torch, data, cap), True: reference_weighted(torch, data, cap)}
    row = {}
    for head in ("logp", "grpo"):
        ref = refs[head == "grpo"]
        row[f"trl-{head}"] = gpu_trl_head.measure(torch, build(torch, f"trl-{head}", cap), data, ref, args, "cuda")
        for rep in (0, 1):
            for vname, v in VARIANTS.items():
                setv(v)
                plans = []
                ts.plan_columns = (lambda f: (lambda *a: (plans.append(f(*a)), plans[-1])[1]))(ts.plan_columns)
                r = gpu_trl_head.measure(torch, build(torch, f"ours-{head}", cap), data, ref, args, "cuda")
                r["plan"] = str(plans[-1]) if plans else None
                row[f"{vname}-{head}-{rep}"] = r
                print(name, head, vname, rep, json.dumps(r), flush=True)
                gpu_bench.cleanup(torch, "cuda")
    setv(VARIANTS["cols8k"])
    out[name] = row
    del data, refs
    gpu_bench.cleanup(torch, "cuda")
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "col_ab.json"), "w"), indent=1)
for name, row in out.items():
    for head in ("logp", "grpo"):
        t = row[f"trl-{head}"]["ms"]
        cells = [f"{v}: " + ", ".join(f"{row[f'{v}-{head}-{k}']['ms']:.2f}" for k in (0, 1)) for v in VARIANTS]
        print(f"{name:12s} {head}: trl {t:.2f} | " + " | ".join(cells))

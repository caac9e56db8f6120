"""Where ours-sft's time goes against ours-loss (kernels grouped by name, ms per fwd+bwd)."""
import json, os, sys, torch
from collections import defaultdict
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_bench, gpu_trl_head
from trl_head_impls import build
from torch.profiler import profile, ProfilerActivity
torch.backends.cuda.matmul.allow_tf32 = False
res = {}
for name in sys.argv[1].split(","):
    n, H, V, cap = gpu_trl_head.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    hid = data["hidden"].clone().requires_grad_(); W = data["weight"].clone().requires_grad_()
    y = data["labels"]
    for impl in ("ours-sft", "ours-loss", "ours-logp"):
        fn = build(torch, impl, cap)
        def step():
            loss = fn(hid, W, y)
            return torch.autograd.grad(loss, (hid, W))
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        iters = 3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
        agg = defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = e.name[:90]
                agg[k][0] += e.device_time_total / 1000 / iters
                agg[k][1] += 1 / iters
        top = sorted(agg.items(), key=lambda kv: -kv[1][0])[:12]
        total = sum(v[0] for v in agg.values())
        res[f"{name}/{impl}"] = {"total_ms": round(total, 2), "top": [(k, round(v[0], 2), round(v[1], 1)) for k, v in top]}
        print(f"\n== {name} {impl}: kernels {total:.2f} ms/iter", flush=True)
        for k, (ms, c) in top:
            print(f"  {ms:8.2f} ms  x{c:6.1f}  {k}", flush=True)
    del data, hid, W
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "prof_stats.json"), "w"), indent=1)

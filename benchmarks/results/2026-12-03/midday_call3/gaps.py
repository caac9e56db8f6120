"""Where the device idles in one fwd+bwd of the SFT head (ours-sft) vs the loss, Gemma-2 shape:
torch.profiler trace; kernel timeline gaps >= 20 us, with the CPU-side sync / copy events that
overlap each gap. Prints total kernel time, wall of the step, and the largest gaps."""
import json, os, sys
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_bench, gpu_trl_head
from trl_head_impls import build
OUT = os.environ.get("OUT", "/tmp")
res = {}
for shape in ("gemma2-2b", "gemma3-270m"):
    n, H, V, cap = gpu_trl_head.SHAPES[shape]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    hid = data["hidden"].clone().requires_grad_(); W = data["weight"].clone().requires_grad_(); y = data["labels"]
    for impl in ("ours-sft", "ours-loss", "trl-sft"):
        fn = build(torch, impl, cap)
        def step():
            hid.grad = W.grad = None
            fn(hid, W, y).backward()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        path = os.path.join(OUT, f"trace_{shape}_{impl}.json")
        prof.export_chrome_trace(path)
        ev = json.load(open(path))["traceEvents"]
        kern = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
                      if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
        cpu = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in ev
               if e.get("cat") in ("cuda_runtime", "cpu_op") and "dur" in e]
        busy = sum(b - a for a, b, _ in kern)
        gaps = []
        for (a0, a1, an), (b0, b1, bn) in zip(kern, kern[1:]):
            if b0 - a1 >= 20:
                over = sorted({c[2] for c in cpu if c[0] < b0 and c[1] > a1 and c[1] - c[0] > 10
                               and any(k in c[2] for k in ("ynchron", "emcpy", "item", "nonzero", "local_scalar", "is_nonzero", "all", "tolist", "eq"))})[:6]
                gaps.append((round(b0 - a1, 1), an[:50], bn[:50], over))
        span = kern[-1][1] - kern[0][0]
        gaps.sort(reverse=True)
        res[f"{shape}/{impl}"] = {"span_us": round(span), "busy_us": round(busy), "idle_us": round(span - busy),
                                  "n_gaps": len(gaps), "gaps_total_us": round(sum(g[0] for g in gaps)), "top": gaps[:12]}
        print(shape, impl, json.dumps(res[f"{shape}/{impl}"])[:2500], flush=True)
        os.remove(path)
    del data, hid, W
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(OUT, "gaps.json"), "w"), indent=1)

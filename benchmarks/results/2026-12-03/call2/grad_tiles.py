"""grad_tma_kernel variants in the zero-logits fwd+bwd: tiles, epilogue split, TMA store.
Median of 5 after a warm-up, variants alternated twice in one process; plus the kernel's
own time from the profiler for the base and the best variant."""
import json, os, sys, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_bench
from fused_ce_patch import fused_linear_cross_entropy as flce
from fused_ce_patch.backends.triton import launch as L

def t(fn, n=5):
    fn(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn(); ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))[n // 2]

rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
VARIANTS = {
    "base": ((128, 128, 64, 4, 8), 1, False),
    "base-tmast": ((128, 128, 64, 4, 8), 1, True),
    "128x128-s2": ((128, 128, 64, 4, 8), 2, True),
    "128x256-s3-split2": ((128, 256, 64, 3, 8), 2, False),
    "128x256-s3-split2-tmast": ((128, 256, 64, 3, 8), 2, True),
    "256x128-s3-split2-tmast": ((256, 128, 64, 3, 8), 2, True),
    "256x128-s3-tmast": ((256, 128, 64, 3, 8), 1, True),
}
shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["gemma3-270m", "gemma2-2b", "llama3-8b", "qwen2.5-7b"]
out = {"env": gpu_bench.environment(torch, "cuda"), "rows": {}}
print(json.dumps(out["env"]), flush=True)
for name in shapes:
    n, H, V, cap = gpu_bench.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    hid = data["hidden"].requires_grad_(); W = data["weight"].requires_grad_(); y = data["labels"]
    def step():
        loss = flce(hid, W, y, softcap=cap, logits_budget=0, backend="triton")
        return (loss.detach(), *torch.autograd.grad(loss, (hid, W)))
    row, res = {}, {}
    for rep in ("", "2"):
        for tag, (tiles, split, store) in VARIANTS.items():
            L.TMA_GRAD_TILES, L.TMA_GRAD_SPLIT_N, L.TMA_GRAD_STORE = tiles, split, store
            try:
                res.setdefault(tag, step())
                row[tag + rep] = round(t(step), 3)
            except Exception as e:
                row[tag + rep] = repr(e)[:300]
    L.TMA_GRAD_TILES, L.TMA_GRAD_SPLIT_N, L.TMA_GRAD_STORE = VARIANTS["base"]
    row["rel_vs_base"] = {k: [f"{rel(a, b):.1e}" for a, b in zip(v, res["base"])] for k, v in res.items()
                          if k != "base"}
    out["rows"][name] = row
    print(name, json.dumps(row), flush=True)
    del data, hid, W, res
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "grad_tiles.json"), "w"), indent=1)

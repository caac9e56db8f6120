"""In-place zero-logits backward: a floor on the L2-sized chunk width (MIN_L2_CHUNK_COLS 128,
the current rule, vs 1024 / 2048) where many rows make the L2 limit narrow (Gemma-3-270M and
Llama-3 at 32K rows; Gemma-2 as a control, whose L2 width is 4224). Median of 5 after a
warm-up, variants alternated twice in one process."""
import json, os, sys, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_bench
from fused_ce_patch import fused_linear_cross_entropy as flce
from fused_ce_patch.backends.triton import zero_logits_inplace as zi

def t(fn, n=5):
    fn(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn(); ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))[n // 2]

rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
out = {"env": gpu_bench.environment(torch, "cuda"), "rows": {}}
for name in ["gemma3-270m", "llama3-8b-long", "gemma2-2b"]:
    n, H, V, cap = gpu_bench.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    hid = data["hidden"].requires_grad_(); W = data["weight"].requires_grad_(); y = data["labels"]
    def step():
        loss = flce(hid, W, y, softcap=cap, logits_budget=0, backend="triton")
        return (loss.detach(), *torch.autograd.grad(loss, (hid, W)))
    row, res = {}, {}
    for rep in ("", "2"):
        for cols in (128, 1024, 2048):
            zi.MIN_L2_CHUNK_COLS = cols
            res.setdefault(cols, step())
            row[f"floor{cols}{rep}"] = round(t(step), 3)
    zi.MIN_L2_CHUNK_COLS = 128
    row["rel_vs_128"] = {k: [f"{rel(a, b):.1e}" for a, b in zip(v, res[128])] for k, v in res.items() if k != 128}
    out["rows"][name] = row
    print(name, json.dumps(row), flush=True)
    del data, hid, W, res
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "floor.json"), "w"), indent=1)

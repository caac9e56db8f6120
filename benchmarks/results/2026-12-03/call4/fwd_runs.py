"""Zero-logits TMA forward: per-tile partials (lse_tma_kernel, vocabulary slices) vs runs of
column blocks (lse_tma_runs_kernel, one launch); at Gemma-3 also the Triton forward (the
default there). Forward alone (no_grad) and fwd+bwd; median of 5 (fwd: 9) after a warm-up,
variants alternated twice in one process.
(Measured tree: `launch.TMA_FORWARD_RUNS` switched the kernel; the final code chooses by
`launch.TMA_RUNS_MIN_ROWS_PER_HIDDEN` instead.)"""
import json, os, sys, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_bench
from fused_ce_patch import fused_linear_cross_entropy as flce
from fused_ce_patch.backends.triton import launch as L, zero_logits_inplace as zi

def t(fn, n=5):
    fn(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn(); ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))[n // 2]

rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
def setv(runs, ws, rows_per_h):
    L.TMA_FORWARD_RUNS, L.TMA_WARP_SPECIALIZE = runs, ws
    zi.MAX_ROWS_PER_HIDDEN = rows_per_h
VARIANTS = {"tiles": (False, True, 64), "runs": (True, True, 64), "runs-nows": (True, False, 64)}
shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["gemma3-270m", "gemma2-2b", "llama3-8b", "qwen2.5-7b", "llama2-7b", "llama3-8b-long"]
out = {"env": gpu_bench.environment(torch, "cuda"), "rows": {}}
print(json.dumps(out["env"]), flush=True)
for name in shapes:
    n, H, V, cap = gpu_bench.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    hid = data["hidden"].requires_grad_(); W = data["weight"].requires_grad_(); y = data["labels"]
    def step():
        loss = flce(hid, W, y, softcap=cap, logits_budget=0, backend="triton")
        return (loss.detach(), *torch.autograd.grad(loss, (hid, W)))
    def fwd():
        with torch.no_grad():
            return flce(hid, W, y, softcap=cap, logits_budget=0, backend="triton")
    variants = dict(VARIANTS)
    if n > 16 * H:
        variants["triton-fwd"] = (True, True, 16)
    row, res = {}, {}
    for rep in ("", "2"):
        for tag, v in variants.items():
            setv(*v)
            try:
                res.setdefault(tag, step())
                row["fwd " + tag + rep] = round(t(fwd, 9), 3)
                row[tag + rep] = round(t(step), 3)
            except Exception as e:
                row[tag + rep] = repr(e)[:300]
    setv(True, True, 16)
    row["rel_vs_tiles"] = {k: [f"{rel(a, b):.1e}" for a, b in zip(v, res["tiles"])] for k, v in res.items()
                           if k != "tiles"}
    out["rows"][name] = row
    print(name, json.dumps(row), flush=True)
    del data, hid, W, res
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "fwd_runs.json"), "w"), indent=1)

"""A/B in one process: the zero-logits forward as the TMA GEMM with the LSE in its epilogue
(new default on Hopper) vs the cuBLAS matmul forward vs the Triton forward; the TMA kernel's
tiles; the *_cols kernels' fast math. Median of 7 after one warm-up, variants alternated."""
import json, os, sys, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_bench
from fused_ce_patch import fused_linear_cross_entropy as flce
from fused_ce_patch.backends.triton import launch, zero_logits as zl

def t(fn, n=7):
    fn(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn(); ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))[n // 2]

rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
MODES = {"tma": (True, True), "matmul": (False, True), "triton": (False, False)}
out = {"env": gpu_bench.environment(torch, "cuda"), "ab": {}, "tiles": {}, "fast": {}}
print(json.dumps(out["env"]), flush=True)
for name in ["llama3-8b", "gemma2-2b", "qwen2.5-7b", "llama2-7b", "gemma3-270m", "llama3-8b-long"]:
    n, H, V, cap = gpu_bench.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    hid = data["hidden"].requires_grad_(); W = data["weight"].requires_grad_(); y = data["labels"]
    fwd = lambda: flce(hid, W, y, softcap=cap, logits_budget=0, backend="triton")
    def step():
        loss = fwd()
        return (loss.detach(), *torch.autograd.grad(loss, (hid, W)))
    row, res = {}, {}
    for tag in ["tma", "matmul", "triton", "tma2", "matmul2"]:
        zl.TMA_FORWARD, zl.MATMUL_FORWARD = MODES[tag.rstrip("2")]
        res.setdefault(tag.rstrip("2"), step())
        row[tag + "_fwd"] = t(fwd)
        row[tag + "_fwdbwd"] = t(step)
    zl.TMA_FORWARD, zl.MATMUL_FORWARD = True, True
    row["rel_tma_vs_matmul"] = [rel(a, b) for a, b in zip(res["tma"], res["matmul"])]
    row["rel_tma_vs_triton"] = [rel(a, b) for a, b in zip(res["tma"], res["triton"])]
    torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    step(); torch.cuda.synchronize()
    row["tma_peak_extra_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    if name in ("llama3-8b", "gemma2-2b", "gemma3-270m"):
        tiles = {}
        for cfg, ws in [((128, 256, 64, 3, 8), True), ((128, 256, 64, 3, 8), False),
                        ((128, 256, 64, 4, 8), True), ((256, 128, 64, 3, 8), True),
                        ((128, 256, 64, 3, 8), True)]:
            launch.TMA_FORWARD_TILES, launch.TMA_WARP_SPECIALIZE = cfg, ws
            key = f"{cfg} ws={ws}"
            try:
                tiles[key if key not in tiles else key + " again"] = t(fwd)
            except Exception as e:
                tiles[key] = repr(e)[:100]
        launch.TMA_FORWARD_TILES, launch.TMA_WARP_SPECIALIZE = (128, 256, 64, 3, 8), True
        out["tiles"][name] = tiles
        print(name, "tiles", json.dumps(tiles), flush=True)
    if name in ("llama3-8b", "gemma2-2b"):
        fast = {}
        for tag, f in [("precise", False), ("fast", True), ("precise2", False), ("fast2", True)]:
            launch.ZERO_FAST_MATH = f
            o = step()
            fast[tag] = t(step)
            fast.setdefault("outs", {})[tag] = o
        outs = fast.pop("outs")
        fast["rel_fast_vs_precise"] = [rel(a, b) for a, b in zip(outs["fast"], outs["precise"])]
        launch.ZERO_FAST_MATH = True
        out["fast"][name] = fast
        print(name, "fast", json.dumps(fast), flush=True)
    out["ab"][name] = row
    print(name, json.dumps(row), flush=True)
    del data, hid, W, res
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "zero_tma_ab.json"), "w"), indent=1)

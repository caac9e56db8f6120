"""A/B in one process: the in-place zero-logits backward with each chunk's gradient from one
TMA GEMM with the gradient in its epilogue (zero_logits_inplace.TMA_GRAD) vs cuBLAS float32
matmul + logits_grad_cols; grad-kernel tiles; Gemma-3 with the in-place backward forced.
Median of 7 after one warm-up, variants alternated."""
import json, os, sys, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_bench
from fused_ce_patch import fused_linear_cross_entropy as flce
from fused_ce_patch.backends.triton import launch, zero_logits as zl, zero_logits_inplace as zi

def t(fn, n=7):
    fn(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn(); ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))[n // 2]

rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
out = {"env": gpu_bench.environment(torch, "cuda"), "ab": {}, "tiles": {}}
print(json.dumps(out["env"]), flush=True)
only = sys.argv[1:] or ["llama3-8b", "gemma2-2b", "qwen2.5-7b", "llama2-7b", "llama3-8b-long",
                        "gemma3-270m"]
for name in only:
    n, H, V, cap = gpu_bench.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    hid = data["hidden"].requires_grad_(); W = data["weight"].requires_grad_(); y = data["labels"]
    fwd = lambda: flce(hid, W, y, softcap=cap, logits_budget=0, backend="triton")
    def step():
        loss = fwd()
        return (loss.detach(), *torch.autograd.grad(loss, (hid, W)))
    row, res = {}, {}
    forced = name == "gemma3-270m"
    if forced:
        zi.MAX_ROWS_PER_HIDDEN = 64
        zl.MATMUL_FORWARD = False  # keep the Triton forward there (its rule)
        zl.TMA_FORWARD = False
    for tag in ["tma", "cols", "tma2", "cols2"]:
        zi.TMA_GRAD = tag.startswith("tma")
        try:
            res.setdefault(tag.rstrip("2"), step())
            row[tag] = t(step)
        except Exception as e:
            row[tag] = repr(e)[:300]
    zi.TMA_GRAD = True
    if forced:
        zi.MAX_ROWS_PER_HIDDEN = 16
        row["tiled_default"] = t(step)
        zl.MATMUL_FORWARD = True; zl.TMA_FORWARD = True
    if len(res) == 2:
        row["rel_tma_vs_cols"] = [rel(a, b) for a, b in zip(res["tma"], res["cols"])]
    if n <= 8192 and len(res) == 2:
        ref = gpu_bench.reference(torch, data, cap)
        for k in ("tma", "cols"):
            row["err_" + k] = [rel(a, ref[b]) for a, b in zip(res[k], ("loss", "dh", "dw"))]
        del ref
    if name in ("llama3-8b", "gemma2-2b"):
        tiles = {}
        for cfg, ws in [((128, 256, 64, 4, 8), True), ((128, 256, 64, 3, 8), True),
                        ((128, 128, 64, 4, 8), True), ((128, 128, 64, 4, 4), False),
                        ((256, 128, 64, 3, 8), True), ((128, 256, 64, 4, 8), False),
                        ((128, 256, 64, 4, 8), True)]:
            launch.TMA_GRAD_TILES, launch.TMA_WARP_SPECIALIZE = cfg, ws
            key = f"{cfg} ws={ws}"
            try:
                tiles[key if key not in tiles else key + " again"] = t(step, 5)
            except Exception as e:
                tiles[key] = repr(e)[:200]
        launch.TMA_GRAD_TILES, launch.TMA_WARP_SPECIALIZE = (128, 256, 64, 4, 8), True
        out["tiles"][name] = tiles
        print(name, "tiles", json.dumps(tiles), flush=True)
    out["ab"][name] = row
    print(name, json.dumps(row), flush=True)
    del data, hid, W, res
    torch.cuda.empty_cache()
# row groups of the TMA forward (review fix of 3f1135a, not run on a GPU before)
data = gpu_bench.make_inputs(torch, 4096, 512, 5000, "cuda")
hid, W, y = data["hidden"], data["weight"], data["labels"]
res = {}
for tag, part in [("groups", 16 * 1000), ("one", 4 * 2**20)]:
    launch.TMA_PART_BYTES = part
    res[tag] = flce(hid, W, y, logits_budget=0, backend="triton", reduction="none")
launch.TMA_PART_BYTES = 4 * 2**20
zl.TMA_FORWARD = False
res["matmul"] = flce(hid, W, y, logits_budget=0, backend="triton", reduction="none")
zl.TMA_FORWARD = True
out["row_groups"] = {"groups_vs_one": rel(res["groups"], res["one"]),
                     "groups_vs_matmul": rel(res["groups"], res["matmul"])}
print("row_groups", out["row_groups"], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "grad_tma_ab.json"), "w"), indent=1)

"""Zero-logits in-place backward: row-blocked narrow chunks (zero_logits_inplace.ROW_BLOCKS,
ROW_BLOCK_MIN_ROWS 1024 / 2048) vs whole chunks of all rows (off), fwd+bwd ms, median of 5
after a warm-up, variants alternated twice in one process; the blocked steps taken; gradients
against the whole-chunk variant's. Then the exact 4-matmul floor (cuBLAS: forward logits of
all rows, then logits, dH, dW of the counted rows) beside CCE default and CCE exact."""
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

steps = []
orig = zi._Chunks.blocked
def spy(self, step, *a, **k):
    steps.append(step); return orig(self, step, *a, **k)
zi._Chunks.blocked = spy

rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
out = {"env": gpu_bench.environment(torch, "cuda"), "rows": {}, "floor": {}}
VARIANTS = {"off": (False, 1024), "rb1024": (True, 1024), "rb2048": (True, 2048)}
names = sys.argv[1].split(",")
for name in names:
    n, H, V, cap = gpu_bench.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    hid = data["hidden"].requires_grad_(); W = data["weight"].requires_grad_(); y = data["labels"]
    def step():
        loss = flce(hid, W, y, softcap=cap, logits_budget=0, backend="triton")
        return (loss.detach(), *torch.autograd.grad(loss, (hid, W)))
    row, res = {}, {}
    for rep in ("", "2"):
        for k, (on, rows) in VARIANTS.items():
            zi.ROW_BLOCKS, zi.ROW_BLOCK_MIN_ROWS = on, rows
            if k not in res:
                steps.clear()
                res[k] = step()
                row[f"{k}_steps"] = len(steps)
                row[f"{k}_blocks"] = sum(-(-(n if not s.scratch else n) // s.block) for s in steps)
                row[f"{k}_cols"] = [s.cols for s in steps][:6] + (["..."] if len(steps) > 6 else [])
            row[f"{k}{rep}"] = round(t(step), 3)
    zi.ROW_BLOCKS, zi.ROW_BLOCK_MIN_ROWS = True, 1024
    row["rel_vs_off"] = {k: [f"{rel(a, b):.1e}" for a, b in zip(v, res["off"])] for k, v in res.items() if k != "off"}
    row["loss_equal"] = {k: bool(torch.equal(v[0], res["off"][0])) for k, v in res.items()}
    out["rows"][name] = row
    print(name, json.dumps(row), flush=True)
    del res
    if name in ("gemma2-2b", "gemma3-270m"):
        h = hid.detach(); w = W.detach(); hc = h[y != -100]
        def four():
            z0 = h @ w.t(); del z0
            z = hc @ w.t()
            return (z @ w, z.t() @ hc)
        fl = {"cublas_4mm": round(t(four), 3)}
        from cut_cross_entropy import linear_cross_entropy as lce
        for k, kw in (("cce", {}), ("cce_exact", {"filter_eps": None})):
            def c():
                loss = lce(hid, W, y, softcap=cap, **kw)
                return torch.autograd.grad(loss, (hid, W))
            fl[k] = round(t(c), 3)
        zi.ROW_BLOCKS = True
        fl["ours_zero"] = round(t(step), 3)
        out["floor"][name] = fl
        print(name, "floor", json.dumps(fl), flush=True)
    del data, hid, W
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "rowblk.json"), "w"), indent=1)

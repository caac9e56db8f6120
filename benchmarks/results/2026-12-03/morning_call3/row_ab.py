"""The per-token statistics row kernel alone on one logits chunk of each shape (the chunk the
default budget gives): old (one max a block, tl.exp), seg (16 segments, PTX exp, per-lane
first maximum), beat (seg with the 'column ahead of the target' top-1: one int array instead
of two), across launch configs; the loss row kernel for reference. Median of 15 launches,
CUDA events around the launch only, the chunk refilled before each."""
import json, os, sys, math, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), ".gpu_probe"))
import old_stats_kernels as K_old, seg_stats_kernels as K_seg, beat_stats_kernels as K_beat
from fused_ce_patch.backends.triton.kernels import logits_grad_inplace_kernel
torch.manual_seed(0)
SHAPES = {"gemma3": (508, 640, 262144, None), "gemma2": (492, 2304, 256000, 30.0),
          "llama3": (922, 4096, 128256, None), "qwen2.5": (820, 3584, 152064, None)}
CONFIGS = [(4096, 16, 8, 3), (4096, 16, 16, 3), (2048, 8, 8, 3), (2048, 8, 4, 3), (1024, 4, 4, 3)]
def launch(mod, z, y, bufs, cfg, mode, cap):
    r, V = z.shape
    bv, sr, w, st = cfg
    mx, ls, nll, ent, top1, coef, glp = bufs
    stats = mode in ("sft", "stats"); grad = mode in ("sft", "grad")
    kw = dict(HAS_SOFTCAP=cap is not None, STATS=stats, ENTROPY=stats, TOP1=stats, MEAN=False, SQ=False,
              GRAD=grad, G_LP=0 if not grad else (1 if mode == "sft" else 2), G_ENT=False,
              BLOCK_V=bv, FIX_RNE=False, NUM_STAGES=st, num_warps=w)
    if mod is not K_old:
        kw.update(SUB_ROWS=sr, FAST_MATH=True)
    mod.token_stats_row_kernel[(r,)](z, z.stride(0), y, mx, ls, nll, ent, top1, mx, mx, coef, glp, 1.0, mx,
                                     V, 1.0, float(cap or 1.0), 1.0, **kw)
def launch_loss(z, y, bufs, cap):
    r, V = z.shape
    mx, ls, nll, ent, top1, coef, glp = bufs
    logits_grad_inplace_kernel[(r,)](z, z.stride(0), y, mx, ls, nll, coef, glp, 1.0 / r, r, V, float(cap or 1.0), 0.0, 0.0,
        HAS_SOFTCAP=cap is not None, SMOOTHING=False, Z_LOSS=False, SCALE_MODE=0, COMPUTE_LSE=True, WRITE_GRAD=True,
        BLOCK_V=4096, FIX_RNE=False, NUM_STAGES=3, LANE_SUMS=True, PERSISTENT=False, SUB_ROWS=16, FAST_MATH=True, num_warps=8)
def timed(fn, z, z0, n=15):
    ts = []
    for i in range(n + 2):
        z.copy_(z0)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        if i >= 2: ts.append(a.elapsed_time(b))
    return round(sorted(ts)[n // 2], 3)
out = {}
for name, (r, H, V, cap) in SHAPES.items():
    h = torch.randn(r, H, device="cuda").bfloat16(); W = (torch.randn(V, H, device="cuda") / math.sqrt(H)).bfloat16()
    z0 = h @ W.t(); z = z0.clone(); y = torch.randint(0, V, (r,), device="cuda")
    def mk():
        f = lambda: torch.empty(r, device="cuda")
        return [f(), f(), f(), f(), torch.empty(r, device="cuda", dtype=torch.int8), f(), torch.rand(r, device="cuda")]
    row = {}
    bufs = mk()
    row["loss-kernel"] = timed(lambda: launch_loss(z, y, bufs, cap), z, z0)
    ref = {}
    for mode in ("sft", "stats", "grad"):
        for cfg in CONFIGS:
            for kname, mod in (("old", K_old), ("seg", K_seg), ("beat", K_beat)):
                if mod is K_old and cfg[1] != CONFIGS[0][1] and cfg != (2048, 8, 8, 3):
                    continue
                key = f"{mode}/{kname}/{cfg[0]}x{cfg[1]}w{cfg[2]}s{cfg[3]}"
                b = mk()
                if mode == "grad":  # stats first (old kernel), then time the grad pass
                    z.copy_(z0); launch(K_old, z, y, b, (4096, 16, 8, 3), "stats", cap)
                try:
                    z.copy_(z0); launch(mod, z, y, b, cfg, mode, cap); torch.cuda.synchronize()
                    res = [t.clone() for t in b[:5]] + [z.clone() if mode != "stats" else None]
                    row[key] = timed(lambda: launch(mod, z, y, b, cfg, mode, cap), z, z0)
                except Exception as exc:
                    row[key] = f"error {type(exc).__name__}: {str(exc)[:120]}"; continue
                if mode not in ref:
                    ref[mode] = res
                else:
                    rr = ref[mode]
                    d = {}
                    if mode != "grad":
                        d["lse"] = f"{((res[0] + res[1]) - (rr[0] + rr[1])).abs().max().item():.1e}"
                        d["nll"] = f"{((res[2] - rr[2]).abs().max()).item():.1e}"
                        d["ent"] = f"{((res[3] - rr[3]).abs().max()).item():.1e}"
                        d["top1_diff"] = int((res[4] != rr[4]).sum().item())
                    if res[5] is not None:
                        d["g"] = f"{((res[5].float() - rr[5].float()).norm() / rr[5].float().norm()).item():.1e}"
                    row[key + ":diff"] = d
        print(name, mode, {k: v for k, v in row.items() if k.startswith(mode) and not k.endswith(":diff")}, flush=True)
    print(name, "loss-kernel", row["loss-kernel"], "diffs", {k: v for k, v in row.items() if k.endswith(":diff")}, flush=True)
    out[name] = row
    del z, z0, h, W
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "row_ab.json"), "w"), indent=1)

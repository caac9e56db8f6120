"""Zero-logits at Gemma shapes: Gemma-3-270M (32K rows, N/H = 51) on the tiled kernels (default,
N/H > MAX_ROWS_PER_HIDDEN = 16) vs the in-place backward forced (MAX_ROWS_PER_HIDDEN raised), at
chunk widths None (L2 rule) / 256 / 128; Gemma-2 (softcap 30) in-place at MAX_CHUNK_COLS None /
512 / 768 / 2048; CCE default beside. 10 % ignored, bf16, median of 5 after a warm-up. Gradients
compared with the default variant. Then a torch.profiler step of Gemma-2 in-place and Gemma-3
in-place (top kernels)."""
import json, math, sys
import torch
from fused_ce_patch import fused_linear_cross_entropy as f
from fused_ce_patch.backends.triton import zero_logits_inplace as zi
dev = "cuda"
SH = {"gemma3-32k": (32768, 640, 262144, None), "gemma2": (8192, 2304, 256000, 30.0)}
VARIANTS = {"gemma3-32k": [("tiled", 16, None), ("inplace", 10**6, None), ("inplace-256", 10**6, 256),
                           ("inplace-128", 10**6, 128)],
            "gemma2": [("inplace", 16, None), ("inplace-512", 16, 512), ("inplace-768", 16, 768),
                       ("inplace-2048", 16, 2048)]}
try:
    from cut_cross_entropy import linear_cross_entropy as cce
except Exception as exc:
    cce = None; print("no cce", exc)

def timeit(step, n=5):
    step(); torch.cuda.synchronize(); ts = []
    for _ in range(n):
        e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
        e0.record(); step(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    return round(sorted(ts)[n // 2], 2)

for name, (n, h, v, cap) in SH.items():
    g = torch.Generator(device=dev).manual_seed(0)
    hid = torch.randn(n, h, device=dev, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device=dev, generator=g) / math.sqrt(h)).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device=dev, generator=g); y[torch.rand(n, device=dev, generator=g) < 0.1] = -100
    res, grads = {}, {}
    for label, rows, cols in VARIANTS[name] * 2:
        zi.MAX_ROWS_PER_HIDDEN, zi.MAX_CHUNK_COLS = rows, cols
        def step():
            hid.grad = None; w.grad = None
            f(hid, w, y, logits_budget=0, backend="triton", softcap=cap).backward()
        torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        res.setdefault(label, []).append(timeit(step))
        grads.setdefault(label, (hid.grad.float().clone(), w.grad.float().clone()))
        res.setdefault(label + "_extraMiB", round((torch.cuda.max_memory_allocated() - base) / 2**20))
    zi.MAX_ROWS_PER_HIDDEN, zi.MAX_CHUNK_COLS = 16, None
    if cce is not None:
        def cstep():
            hid.grad = None; w.grad = None
            yy = y.clone()
            cce(hid, w, yy, softcap=cap, ignore_index=-100).backward()
        res["cce_default"] = [timeit(cstep), timeit(cstep)]
    h0, w0 = next(iter(grads.values()))
    diff = {k: [round(((hh - h0).norm() / h0.norm()).item(), 7), round(((ww - w0).norm() / w0.norm()).item(), 7)]
            for k, (hh, ww) in grads.items()}
    print(json.dumps({"shape": name, "ms": res, "rel_diff_vs_first": diff}), flush=True)
    del grads
    # profile the in-place default
    zi.MAX_ROWS_PER_HIDDEN = 10**6
    from torch.profiler import profile, ProfilerActivity
    step(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        hid.grad = None; w.grad = None
        f(hid, w, y, logits_budget=0, backend="triton", softcap=cap).backward(); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70), flush=True)
    zi.MAX_ROWS_PER_HIDDEN = 16
    del hid, w, y; torch.cuda.empty_cache()

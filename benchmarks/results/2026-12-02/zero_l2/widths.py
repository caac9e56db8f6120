"""Zero-logits in-place backward: chunk width sweep (L2-resident chunks?), one process.
Also the Gemma-3 32K shape with the in-place path forced (MAX_ROWS_PER_HIDDEN raised)."""
import json, math, os, sys
import torch
from fused_ce_patch import fused_linear_cross_entropy as f
from fused_ce_patch.backends.triton import zero_logits_inplace as zi
dev = "cuda"
print("L2 bytes", torch.cuda.get_device_properties(0).L2_cache_size, flush=True)
SH = {"llama3": (8192, 4096, 128256, None, [None, 1024, 512, 256]),
      "gemma2": (8192, 2304, 256000, 30.0, [None, 512, 256]),
      "qwen": (8192, 3584, 152064, None, [None, 1024, 512, 256]),
      "llama2": (8192, 4096, 32000, None, [None, 512, 256]),
      "llama3-32k": (32768, 4096, 128256, None, [None, 512, 256, 128]),
      "gemma3-32k": (32768, 640, 262144, None, ["tiled", None, 256, 128, 64])}
only = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SH)
for name in only:
    n, h, v, cap, widths = SH[name]
    g = torch.Generator(device=dev).manual_seed(0)
    hid = torch.randn(n, h, device=dev, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device=dev, generator=g) / math.sqrt(h)).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device=dev, generator=g); y[torch.rand(n, device=dev, generator=g) < 0.1] = -100
    base = None
    for wd in widths:
        zi.MAX_ROWS_PER_HIDDEN = 16 if wd == "tiled" else 10**6
        zi.MAX_CHUNK_COLS = None if wd == "tiled" else wd
        def step():
            hid.grad = None; w.grad = None
            loss = f(hid, w, y, logits_budget=0, backend="triton", softcap=cap); loss.backward(); return loss
        loss = step(); torch.cuda.synchronize()
        ts = []
        for _ in range(7):
            a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
            a.record(); step(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
        torch.cuda.reset_peak_memory_stats(); m0 = torch.cuda.memory_allocated(); step(); torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - m0) / 2**20
        d = {"shape": name, "width": wd, "ms": sorted(ts)[3], "min": min(ts), "peak_extra_mib_incl_grads": round(peak, 1)}
        if base is None:
            base = (loss.item(), hid.grad.float().clone(), w.grad.float().clone())
        else:
            d["dloss"] = abs(loss.item() - base[0])
            d["dh_rel"] = ((hid.grad.float() - base[1]).norm() / base[1].norm()).item()
            d["dw_rel"] = ((w.grad.float() - base[2]).norm() / base[2].norm()).item()
        print(json.dumps(d), flush=True)
    del hid, w, y, base
    torch.cuda.empty_cache()

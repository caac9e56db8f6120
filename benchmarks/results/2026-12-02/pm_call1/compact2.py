"""A/B in one process: zero-logits in-place backward, all-rows first pass vs counted-rows
first pass (forced: thresholds off), at 10/20/30 % ignored; prints what the shipped rule picks.
Median of 5 after one warm-up, modes alternated twice."""
import json, math, sys
import torch
from fused_ce_patch import fused_linear_cross_entropy as f
from fused_ce_patch.backends.triton import zero_logits_inplace as zi
dev = "cuda"
SH = {"llama3": (8192, 4096, 128256, None), "qwen": (8192, 3584, 152064, None),
      "gemma2": (8192, 2304, 256000, 30.0), "llama2": (8192, 4096, 32000, None)}
rule = (zi.COMPACT_MIN_SAVING, zi.COMPACT_MAX_UNDER)
for name, (n, h, v, cap) in SH.items():
    for frac in (0.1, 0.2, 0.3):
        g = torch.Generator(device=dev).manual_seed(0)
        hid = torch.randn(n, h, device=dev, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(v, h, device=dev, generator=g) / math.sqrt(h)).bfloat16().requires_grad_()
        y = torch.randint(0, v, (n,), device=dev, generator=g); y[torch.rand(n, device=dev, generator=g) < frac] = -100
        m = int((y != -100).sum())
        zi.COMPACT_MIN_SAVING, zi.COMPACT_MAX_UNDER = rule
        picks = zi._compact_pays(n, m, v, h)
        res = {}
        for mode in (False, True, False, True):
            zi.COMPACT = mode
            zi.COMPACT_MIN_SAVING, zi.COMPACT_MAX_UNDER = (0.0, 1.0) if mode else rule
            def step():
                hid.grad = None; w.grad = None
                loss = f(hid, w, y, logits_budget=0, backend="triton", softcap=cap); loss.backward(); return loss
            step(); torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
                a.record(); step(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
            res.setdefault(mode, []).append(round(sorted(ts)[2], 2))
        zi.COMPACT = True; zi.COMPACT_MIN_SAVING, zi.COMPACT_MAX_UNDER = rule
        full = 3 * v * n + 2 * n * n; counted = 3 * v * m - 2 * m * m + 4 * m * n
        print(json.dumps({"shape": name, "ignored": frac, "all_rows_ms": res[False], "counted_ms": res[True],
              "saving_by_count": round(1 - counted / full, 3), "2M/V": round(2 * m / v, 3),
              "rule_picks_counted": picks}), flush=True)
        del hid, w, y, res; torch.cuda.empty_cache()

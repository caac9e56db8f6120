"""A/B in one process (device call of 2026-12-02 ~06:35 UTC, output in compact.log): zero-logits
in-place backward, first pass over the counted rows (COMPACT=True, then no threshold: taken
whenever it saved 2 % of the matmul row-columns) vs all rows; median of 5 after one warm-up,
modes alternated twice; gradients compared between the modes."""
import json, math
import torch
from fused_ce_patch import fused_linear_cross_entropy as f
from fused_ce_patch.backends.triton import zero_logits_inplace as zi
dev = "cuda"
SH = {"llama3": (8192, 4096, 128256, None), "qwen": (8192, 3584, 152064, None),
      "gemma2": (8192, 2304, 256000, 30.0), "llama3-32k": (32768, 4096, 128256, None)}
for name, (n, h, v, cap) in SH.items():
    for frac in (0.1, 0.4):
        g = torch.Generator(device=dev).manual_seed(0)
        hid = torch.randn(n, h, device=dev, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(v, h, device=dev, generator=g) / math.sqrt(h)).bfloat16().requires_grad_()
        y = torch.randint(0, v, (n,), device=dev, generator=g); y[torch.rand(n, device=dev, generator=g) < frac] = -100
        res = {}
        for mode in (False, True, False, True):
            zi.COMPACT = mode
            def step():
                hid.grad = None; w.grad = None
                loss = f(hid, w, y, logits_budget=0, backend="triton", softcap=cap); loss.backward(); return loss
            loss = step(); torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
                a.record(); step(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
            res.setdefault(mode, []).append(sorted(ts)[2])
            if mode not in res.get("grads", {}):
                res.setdefault("grads", {})[mode] = (hid.grad.float().clone(), w.grad.float().clone())
        (h0, w0), (h1, w1) = res["grads"][False], res["grads"][True]
        print(json.dumps({"shape": name, "ignored": frac, "all_rows_ms": res[False], "counted_ms": res[True],
              "dh_rel": ((h1 - h0).norm() / h0.norm()).item(), "dw_rel": ((w1 - w0).norm() / w0.norm()).item()}), flush=True)
        del hid, w, y, res; torch.cuda.empty_cache()

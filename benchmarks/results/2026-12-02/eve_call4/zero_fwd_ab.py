"""A/B in one process: the zero-logits forward as cuBLAS matmuls over vocabulary chunks with
the lse_cols merge kernel (MATMUL_FORWARD = True, new) vs the Triton GEMM+LSE kernel (False,
before). 10 % ignored, bf16; fwd+bwd and forward alone; median of 5 after a warm-up, variants
alternated twice. Loss and gradients of the new variant against the old."""
import json, math
import torch
from fused_ce_patch import fused_linear_cross_entropy as f
from fused_ce_patch.backends.triton import zero_logits as zl
dev = "cuda"
SH = {"llama3": (8192, 4096, 128256, None), "gemma2": (8192, 2304, 256000, 30.0),
      "qwen": (8192, 3584, 152064, None), "llama2": (8192, 4096, 32000, None),
      "llama3-32k": (32768, 4096, 128256, None), "gemma3-32k": (32768, 640, 262144, None)}

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
    res, out = {}, {}
    for mm in (True, False, True, False):
        zl.MATMUL_FORWARD = mm
        key = "matmul" if mm else "triton"
        def step():
            hid.grad = None; w.grad = None
            f(hid, w, y, logits_budget=0, backend="triton", softcap=cap).backward()
        def fwd():
            f(hid, w, y, logits_budget=0, backend="triton", softcap=cap)
        res.setdefault(key + "_fwd_bwd", []).append(timeit(step))
        res.setdefault(key + "_fwd", []).append(timeit(fwd))
        if key not in out:
            hid.grad = None; w.grad = None
            loss = f(hid, w, y, logits_budget=0, backend="triton", softcap=cap); loss.backward()
            out[key] = (loss.item(), hid.grad.float().clone(), w.grad.float().clone())
    zl.MATMUL_FORWARD = True
    (l1, h1, w1), (l0, h0, w0) = out["matmul"], out["triton"]
    diff = {"loss_rel": abs(l1 - l0) / abs(l0), "dh_rel": ((h1 - h0).norm() / h0.norm()).item(),
            "dw_rel": ((w1 - w0).norm() / w0.norm()).item()}
    print(json.dumps({"shape": name, "ms": res, "new_vs_old": diff}), flush=True)
    del hid, w, y, out; torch.cuda.empty_cache()

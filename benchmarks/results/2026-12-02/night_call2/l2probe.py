"""Where the L2-blocked LSE loses: per-chunk timings of the pieces (one chunk, bf16)."""
import os, sys, torch, triton
sys.path.insert(0, os.getcwd())
from fused_ce_patch.backends.triton import chunked_path as cp
from fused_ce_patch.backends.triton.launch import CUDA_LAUNCHERS as L, triton_cdiv
from fused_ce_patch.backends.triton.kernels import lse_cols_kernel
from fused_ce_patch.backends.base import LossSpec

def t(fn, n=20):
    fn(); torch.cuda.synchronize()
    s = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    s[0].record()
    for i in range(n):
        fn(); s[i + 1].record()
    torch.cuda.synchronize()
    d = sorted(s[i].elapsed_time(s[i + 1]) for i in range(n))
    return d[n // 2]

spec = LossSpec()
for name, r, H, V in [("llama3", 921, 4096, 128256), ("gemma3", 955, 640, 262144), ("gemma2", 493, 2304, 256000)]:
    torch.manual_seed(0)
    h = torch.randn(r, H, device="cuda", dtype=torch.bfloat16)
    W = (torch.randn(V, H, device="cuda") * 0.02).bfloat16()
    y = torch.randint(0, V, (r,), device="cuda")
    z = torch.empty(r, V, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(r, device="cuda"); nll = torch.empty(r, device="cuda"); loss = torch.empty(r, device="cuda"); coef = torch.empty(r, device="cuda")
    res = {}
    res["mm_whole"] = t(lambda: torch.mm(h, W.t(), out=z))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for frac in (0.25, 0.5):
        cols = max(128, round(frac * l2 / (r * 2) / 128) * 128)
        blocks = [(v0, min(V, v0 + cols)) for v0 in range(0, V, cols)]
        zc = torch.empty(r * cols, device="cuda", dtype=torch.bfloat16)
        def mm_strided():
            for a, b in blocks:
                torch.mm(h, W[a:b].t(), out=z[:, a:b])
        def mm_contig():
            for a, b in blocks:
                torch.mm(h, W[a:b].t(), out=zc[: r * (b - a)].view(r, b - a))
        res[f"mm_strided_{frac}"] = t(mm_strided)
        res[f"mm_contig_{frac}"] = t(mm_contig)
        st = torch.zeros(4, r, device="cuda")
        for br, bc, w in [(4, 512, 4), (1, 2048, 4), (2, 1024, 8), (8, 256, 4), (1, 4096, 8)]:
            def lse_only():
                for a, b in blocks:
                    blk = z[:, a:b]
                    lse_cols_kernel[(triton_cdiv(r, br),)](blk, blk.stride(0), blk, y, st, r, b - a, a, 1.0,
                        HAS_BIAS=False, HAS_SOFTCAP=False, SMOOTHING=False, BLOCK_R=br, BLOCK_C=bc, num_warps=w)
            def both():
                for a, b in blocks:
                    blk = z[:, a:b]
                    torch.mm(h, W[a:b].t(), out=blk)
                    lse_cols_kernel[(triton_cdiv(r, br),)](blk, blk.stride(0), blk, y, st, r, b - a, a, 1.0,
                        HAS_BIAS=False, HAS_SOFTCAP=False, SMOOTHING=False, BLOCK_R=br, BLOCK_C=bc, num_warps=w)
            res[f"lse_hbm_{frac}_{br}x{bc}w{w}"] = t(lse_only)
            res[f"mm+lse_{frac}_{br}x{bc}w{w}"] = t(both)
    def row_both():
        L.logits_grad(z, y, lse, nll, loss, coef, 1.0, spec, compute_lse=True, write_grad=True)
    def row_lse():
        L.logits_grad(z, y, lse, nll, loss, None, 1.0, spec, compute_lse=True, write_grad=False)
    def row_grad():
        L.logits_grad(z, y, lse, nll, None, coef, 1.0, spec, compute_lse=False, write_grad=True)
    torch.mm(h, W.t(), out=z)
    row_lse()
    res["row_lse+grad"] = t(row_both, 10)
    res["row_lse_only"] = t(row_lse, 10)
    res["row_grad_only"] = t(row_grad, 10)
    def mm_then_lse():
        torch.mm(h, W.t(), out=z); row_lse()
    res["mm_whole+row_lse"] = t(mm_then_lse)
    print(f"== {name} r={r} H={H} V={V}")
    for k, v in res.items():
        print(f"  {k:32s} {v:8.3f} ms")

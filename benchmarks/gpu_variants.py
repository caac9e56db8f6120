"""Where the time of backend "triton" goes, and which launch settings to keep (one GPU).

Question: for the chunked path, how do the row kernel's block size / warps and the logits
budget move the fwd+bwd time; how long does each stage take (the logits matmul, the row
kernel, the dH and dW matmuls) against its floor; and how fast are the zero-logits kernels
against a cuBLAS matmul of the same size?

Prints one table per question and writes ``gpu_variants.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fused_ce_patch import fused_linear_cross_entropy  # noqa: E402
from fused_ce_patch.backends import triton as tb  # noqa: E402
from fused_ce_patch.backends.base import LossSpec  # noqa: E402
from fused_ce_patch.backends.triton import chunked_path, launch  # noqa: E402
from timing import time_ms  # noqa: E402  (the timer of every benchmark)

MiB = 2**20
SHAPES = {
    "llama3-8b": (8192, 4096, 128256, None),
    "gemma2-2b": (8192, 2304, 256000, 30.0),
    "gemma3-270m": (32768, 640, 262144, None),
}


def bench(fn, iters=10, warmup=2):
    return time_ms(fn, iters=iters, warmup=warmup, device="cuda").median


def inputs(n, h, v):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16()
    weight.requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    return hidden, weight, labels


def fwd_bwd(hidden, weight, labels, softcap, budget):
    def run():
        fused_linear_cross_entropy(hidden, weight, labels, softcap=softcap, logits_budget=budget,
                                   backend="triton").backward()  # fmt: skip
        hidden.grad = weight.grad = None

    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--shapes", default="llama3-8b,gemma3-270m")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {"gpu": torch.cuda.get_device_name(), "rows": []}

    def record(**kw):
        out["rows"].append(kw)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in kw.items()), flush=True)  # fmt: skip

    # copy bandwidth and bf16 matmul rate: the two ceilings
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    record(q="ceiling", what="copy GB/s (read+write)", value=2 * x.numel() / ms / 1e6)
    del x, y
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    ms = bench(lambda: a @ a)
    record(q="ceiling", what="bf16 matmul TFLOP/s", value=2 * 8192**3 / ms / 1e9)
    del a

    original = launch.row_kernel_config
    for name in args.shapes.split(","):
        n, h, v, softcap = SHAPES[name]
        hidden, weight, labels = inputs(n, h, v)
        m = int((labels != -100).sum())
        # 1. row kernel launch settings, default budget
        for block_v, warps, stages in ((4096, 8, 3), (8192, 8, 3), (4096, 8, 1), (8192, 16, 4)):
            launch.row_kernel_config = lambda vocab, device, b=block_v, w=warps, st=stages: (
                launch.RowKernelConfig(block_v=min(b, launch._pow2(vocab)), num_warps=w,
                                       num_stages=st))  # fmt: skip
            ms = bench(fwd_bwd(hidden, weight, labels, softcap, None))
            record(q="row-kernel", shape=name, block_v=block_v, warps=warps, stages=stages, ms=ms)
        launch.row_kernel_config = original
        # 3. stages of one chunk at the default budget, times the number of chunks
        rows = chunked_path.plan_rows(m, tb.memory_first_budget(m) // (v * 2))
        chunks = math.ceil(m / rows)
        hc = hidden.detach()[:rows].contiguous()
        w = weight.detach()
        z = torch.empty(rows, v, device="cuda", dtype=torch.bfloat16)
        y = labels.clamp(min=0)[:rows].contiguous()
        lse = torch.empty(rows, device="cuda")
        nll = torch.empty_like(lse)
        loss = torch.empty_like(lse)
        coef = torch.empty_like(lse)
        dw = torch.zeros_like(w)
        spec = LossSpec(softcap=softcap)
        t_mm = bench(lambda: torch.mm(hc, w.t(), out=z))
        t_k = bench(lambda: launch.CUDA_LAUNCHERS.logits_grad(z, y, lse, nll, loss, coef, 1.0,
                                                              spec, compute_lse=True,
                                                              write_grad=True))  # fmt: skip
        t_dh = bench(lambda: torch.mm(z, w))
        t_dw = bench(lambda: dw.addmm_(z.t(), hc))
        flop = 2 * rows * v * h
        record(q="stages", shape=name, rows=rows, chunks=chunks,
               logits_ms=t_mm * chunks, logits_tflops=flop / t_mm / 1e9,
               kernel_ms=t_k * chunks, kernel_gbs=3 * z.numel() * 2 / t_k / 1e6,
               dh_ms=t_dh * chunks, dh_tflops=flop / t_dh / 1e9,
               dw_ms=t_dw * chunks, dw_tflops=flop / t_dw / 1e9)  # fmt: skip
        del z, dw
        # 4. zero-logits: forward and backward alone vs the 3-GEMM floor
        t_fwd = bench(lambda: fused_linear_cross_entropy(hidden.detach(), w, labels,
                                                         softcap=softcap, logits_budget=0,
                                                         backend="triton"), iters=5)  # fmt: skip
        t_all = bench(fwd_bwd(hidden, weight, labels, softcap, 0), iters=5)
        record(q="zero-logits", shape=name, fwd_ms=t_fwd, fwd_tflops=2 * m * v * h / t_fwd / 1e9,
               fwd_bwd_ms=t_all, floor_3gemm_ms=(t_mm + t_dh + t_dw) * chunks)  # fmt: skip
        del hidden, weight, labels, hc, w
        torch.cuda.empty_cache()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_variants.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

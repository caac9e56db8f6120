"""Zero-logits path (``logits_budget=0``): how its time depends on the kernels' tile shapes.

Question (issue 14): the zero-logits backward is bound by float32 atomics, about
``N * V * H * (1 / BLOCK_M + 1 / BLOCK_N)`` element adds for ``BLOCK_M x BLOCK_N`` logit
tiles; the forward (a Triton GEMM with an on-chip log-sum-exp) ran at ~312 TFLOP/s against
cuBLAS's ~750. Do larger or other tiles buy time, and how far from the issue's target
(0.75x Cut Cross-Entropy's default) does the best one land?

Method: ``gpu_bench.make_inputs`` (bf16, 10 % of labels ignored, mean), backend ``"triton"``,
``logits_budget=0``. Each variant replaces the launch module's tile choice
(``launch.forward_tile_config`` / ``launch.backward_tile_config``) for the run; the first
(the default) is the reference of the others' results: the loss, dH and dW of every variant
must agree with it to float32 summation-order noise (printed: max relative difference).
Time: CUDA-event median of ``--iters`` fwd+bwd after one warm-up, and of the forward alone.
A variant that fails to compile or run (e.g. out of shared memory) is reported and skipped.

Writes ``gpu_zero_tiles.json`` under ``--out``; ``--tiny`` is a CPU dry run (interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_bench  # noqa: E402  (inputs, environment)

#: name -> (forward (M, N, K, warps, stages) or None for the default, backward
#: (M, N, K, H, warps, stages) or None)
VARIANTS = {
    "default": (None, None),  # the defaults of launch.py at the time of the run
    "old default": ((128, 128, 64, 8, 3), (128, 128, 64, 64, 8, 2)),  # before 2026-12-01 evening
    "bwd 128x256": (None, (128, 256, 64, 64, 8, 2)),
    "bwd 256x128": (None, (256, 128, 64, 64, 8, 2)),
    "bwd 128x256 h32": (None, (128, 256, 64, 32, 8, 2)),
    "bwd 256x256 h32 w16": (None, (256, 256, 64, 32, 16, 2)),
    "fwd 128x256 s3": ((128, 256, 64, 8, 3), None),
    "fwd 128x128 s4": ((128, 128, 64, 8, 4), None),
    "fwd 128x256 s4": ((128, 256, 64, 8, 4), None),
}
TINY_VARIANTS = {"default": (None, None), "bwd 16x64": (None, (16, 64, 32, 32, 4, 1))}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama3-8b,gemma3-270m")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tiny", action="store_true", help="CPU dry run under the interpreter")
    args = p.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from fused_ce_patch import fused_linear_cross_entropy
    from fused_ce_patch.backends.triton import launch

    dev = "cpu" if args.tiny else "cuda"
    variants = TINY_VARIANTS if args.tiny else {k: VARIANTS[k] for k in args.variants.split(",")}
    shapes = gpu_bench.TINY if args.tiny else {
        k: gpu_bench.SHAPES[k] for k in args.shapes.split(",")
    }
    env = gpu_bench.environment(torch, dev)
    print(json.dumps(env), flush=True)
    default_fwd, default_bwd = launch.forward_tile_config, launch.backward_tile_config
    rows = []
    for shape, (n, h, v, softcap) in shapes.items():
        data = gpu_bench.make_inputs(torch, n, h, v, dev)
        hidden = data["hidden"].detach().requires_grad_()
        weight = data["weight"].detach().requires_grad_()
        labels = data["labels"]

        def loss():
            return fused_linear_cross_entropy(hidden, weight, labels, softcap=softcap,
                                              logits_budget=0, backend="triton")  # fmt: skip

        ref = None
        for name, (fwd, bwd) in variants.items():
            launch.forward_tile_config = default_fwd if fwd is None else (
                lambda dtype, device, *_, c=fwd: launch.TileConfig(c[0], c[1], c[2], 64,
                                                               num_warps=c[3], num_stages=c[4]))
            launch.backward_tile_config = default_bwd if bwd is None else (
                lambda dtype, device, *_, c=bwd: launch.TileConfig(c[0], c[1], c[2], c[3],
                                                               num_warps=c[4], num_stages=c[5]))
            row = {"shape": shape, "variant": name, "N": n, "H": h, "V": v}
            try:
                row.update(run(torch, loss, hidden, weight, args.iters, dev, ref))
                if ref is None:
                    ref = row.pop("_result")
                row.pop("_result", None)
            except Exception as exc:  # one variant that does not fit must not end the run
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            gpu_bench.cleanup(torch, dev)
        launch.forward_tile_config, launch.backward_tile_config = default_fwd, default_bwd
        del data, hidden, weight, labels
        gpu_bench.cleanup(torch, dev)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_zero_tiles.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print("\n| shape | variant | fwd+bwd ms | fwd ms | diff loss / dH / dW vs default |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['variant']} | error: {r['error'][:60]} | | |")
            continue
        d = "(reference)"
        if "diff_dh" in r:
            d = "/".join(f"{r[k]:.1e}" for k in ("diff_loss", "diff_dh", "diff_dw"))
        print(f"| {r['shape']} | {r['variant']} | {r['ms']:.1f} | {r['fwd_ms']:.1f} | {d} |")


def run(torch, loss, hidden, weight, iters, dev, ref):
    from timing import time_ms

    from fused_ce_patch.numerics import relative_error

    def step():
        hidden.grad = weight.grad = None
        out = loss()
        out.backward()
        return out

    out = step()  # warm-up (compiles)
    result = (out.detach().float(), hidden.grad.float(), weight.grad.float())
    times = time_ms(step, iters=iters, device=dev)
    with torch.no_grad():
        fwd_times = time_ms(loss, iters=iters, device=dev)
    row = {"ms": times.median, "fwd_ms": fwd_times.median}
    if ref is None:
        row["_result"] = result
    else:
        row.update(diff_loss=relative_error(result[0], ref[0]),
                   diff_dh=relative_error(result[1], ref[1]),
                   diff_dw=relative_error(result[2], ref[2]))  # fmt: skip
    return row


if __name__ == "__main__":
    main()

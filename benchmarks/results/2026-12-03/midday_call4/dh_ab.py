"""dH's target column in float32 (new) vs through the 16-bit matmul (the fallback, = the code
before) on the chunked loss and the SFT head: fwd+bwd ms and errors vs float32 logits,
alternated twice in one process (gpu_trl_head.measure, median of 10)."""
import argparse, json, os, sys
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_bench, gpu_trl_head
from trl_head_impls import build
from fused_ce_patch.backends.triton import chunked_path as cp
real = cp._mm_fp32
args = argparse.Namespace(iters=10, warmup=3)
out = {}
for name in sys.argv[1].split(","):
    n, H, V, cap = gpu_trl_head.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    ref = gpu_bench.reference(torch, data, cap)
    for rep in (0, 1):
        for variant in ("new", "old"):
            cp._mm_fp32 = real if variant == "new" else (lambda a, b: None if a.dtype in (torch.bfloat16, torch.float16) else real(a, b))
            for impl in ("ours-loss", "ours-sft"):
                r = gpu_trl_head.measure(torch, build(torch, impl, cap), data, ref, args, "cuda")
                out[f"{name}/{impl}/{variant}/{rep}"] = r
                print(name, impl, variant, rep, json.dumps(r), flush=True)
    cp._mm_fp32 = real
    del data, ref
    gpu_bench.cleanup(torch, "cuda")
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "dh_ab.json"), "w"), indent=1)

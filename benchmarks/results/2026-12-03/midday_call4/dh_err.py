"""The chunked path's errors (loss, dH, dW, [db]) against float32 logits at the GPU suite's
real sizes, beside PyTorch's bf16 path: tests/gpu/test_triton_gpu.compare, printed."""
import os, sys, json
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "gpu"))
import test_triton_gpu as t
out = {}
for n, h, v, opts, name in [(4096, 4096, 128256, {}, "llama3"),
                            (2048, 2304, 256000, {"softcap": 30.0}, "gemma2-softcap"),
                            (3001, 1003, 32003, {"label_smoothing": 0.1, "z_loss": 1e-4, "bias": True}, "odd"),
                            (2048, 640, 262144, {"reduction": "none"}, "gemma3-none")]:
    errs = t.compare(n, h, v, None, **opts)
    out[name] = [[float(f"{e:.3g}"), float(f"{et:.3g}")] for e, et in errs]
    print(name, "ours vs torch (loss, dH, dW, db):", out[name], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "dh_err.json"), "w"))

"""dW's per-chunk addmm (dW [V, H] bf16 += dz[V, K] @ h[K, H]) at K rows per chunk: per-row cost,
to size a column-tiled recompute backward (TRL tiles 4096 rows x 32768 columns; ours 256 MiB
chunks of whole rows: 508 rows at Gemma-3, 492 at Gemma-2). Also the logits product and the
dH product at the same K. Median of 9, CUDA events."""
import json, os, torch
def t(fn, n=9):
    fn(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn(); ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))[n // 2]
out = {}
for name, V, H in (("gemma3", 262144, 640), ("gemma2", 256000, 2304), ("llama3", 128256, 4096)):
    W = torch.randn(V, H, device="cuda").bfloat16(); dW = torch.zeros_like(W)
    for K in (508, 1024, 2048, 4096):
        h = torch.randn(K, H, device="cuda").bfloat16()
        for cols in (V, 32768):
            dz = torch.randn(cols, K, device="cuda").bfloat16()  # dz^T, [cols, K] view as used
            Wc, dWc = W[:cols], dW[:cols]
            a = t(lambda: dWc.addmm_(dz, h))
            zc = torch.empty(K, cols, device="cuda", dtype=torch.bfloat16)
            b = t(lambda: torch.mm(h, Wc.t(), out=zc))
            c = t(lambda: torch.mm(zc, Wc, out_dtype=torch.float32))
            key = f"{name}/K{K}/cols{cols}"
            out[key] = {"dW_addmm_ms": round(a, 4), "logits_ms": round(b, 4), "dH_ms": round(c, 4),
                        "dW_us_per_row_per_32kcols": round(a * 1000 / K * 32768 / cols, 3)}
            print(key, out[key], flush=True)
            del dz, zc
    del W, dW
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "dw_rows.json"), "w"), indent=1)

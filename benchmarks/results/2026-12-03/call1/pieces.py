"""Per-chunk pieces of the in-place zero-logits backward at Gemma shapes: cuBLAS dW product
(bf16 out), dH accumulate (fp32 out addmm), TFLOP/s by chunk width."""
import json, os, torch
def t(fn, n=20):
    fn(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn(); ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))[n // 2]
out = {}
for name, m, H, cs in [("gemma3", 29491, 640, [512, 1024, 2048, 4096, 8192]),
                       ("gemma2", 7373, 2304, [2048, 4224, 8192])]:
    h = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(8192, H, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(m, H, device="cuda", dtype=torch.float32)
    for c in cs:
        g = torch.randn(m, c, device="cuda", dtype=torch.bfloat16) * 0.01
        dw = torch.empty(c, H, device="cuda", dtype=torch.bfloat16)
        fl = 2 * m * c * H
        t_dw = t(lambda: torch.mm(g.t(), h, out=dw))
        t_dh = t(lambda: torch.addmm(acc, g, W[:c], out_dtype=torch.float32, out=acc))
        t_z = t(lambda: torch.mm(h, W[:c].t()))
        r = {"dW_ms": t_dw, "dW_tflops": fl / t_dw / 1e9, "dH_ms": t_dh,
             "dH_tflops": fl / t_dh / 1e9, "Z_bf16_ms": t_z, "Z_tflops": fl / t_z / 1e9}
        out[f"{name} c={c}"] = r
        print(name, c, json.dumps({k: round(v, 4) for k, v in r.items()}), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "pieces.json"), "w"), indent=1)

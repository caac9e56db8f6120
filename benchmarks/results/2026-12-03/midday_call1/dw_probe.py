"""Per-chunk cuBLAS probe: dW addmm and dH matmul of one chunk, serial vs on two streams;
dW's time vs rows (K alignment). bf16, median of 15 after 3 warm-ups."""
import json, os, torch
torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
side = torch.cuda.Stream()
main = torch.cuda.current_stream()

def med(fn, n=15, w=3):
    for _ in range(w):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn(); ev[i + 1].record()
    torch.cuda.synchronize()
    return round(sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))[n // 2], 4)

SHAPES = {"gemma2": (2304, 256000, [492, 488, 496, 512, 1024]),
          "qwen2.5": (3584, 152064, [820, 824, 832]),
          "llama3": (4096, 128256, [922, 920, 928, 1024]),
          "gemma3": (640, 262144, [1017, 1016, 1024])}
out = {}
for name, (H, V, rows_list) in SHAPES.items():
    W = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * H ** -0.5
    dW = torch.zeros(V, H, device=dev, dtype=torch.bfloat16)
    res = {}
    for r in rows_list:
        h = torch.randn(r, H, device=dev, dtype=torch.bfloat16)
        z = torch.randn(r, V, device=dev, dtype=torch.bfloat16) * 1e-3
        dh = torch.empty(r, H, device=dev, dtype=torch.float32)
        def dw_op(): dW.addmm_(z.t(), h)
        def dh_op(): torch.mm(z, W, out_dtype=torch.float32, out=dh)
        def lg_op(): torch.mm(h, W.t())
        def serial(): dw_op(); dh_op()
        def conc():
            side.wait_stream(main)
            with torch.cuda.stream(side):
                dw_op()
            dh_op()
            main.wait_stream(side)
        def conc_rev():
            side.wait_stream(main)
            with torch.cuda.stream(side):
                dh_op()
            dw_op()
            main.wait_stream(side)
        row = {"dw": med(dw_op)}
        if r == rows_list[0]:
            row.update(dh=med(dh_op), logits=med(lg_op), serial=med(serial), conc=med(conc),
                       conc_rev=med(conc_rev), serial2=med(serial), conc2=med(conc))
        row["dw_us_per_row"] = round(1000 * row["dw"] / r, 3)
        res[r] = row
        print(name, r, json.dumps(row), flush=True)
        del h, z, dh
    out[name] = res
    del W, dW
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "dw_probe.json"), "w"), indent=1)

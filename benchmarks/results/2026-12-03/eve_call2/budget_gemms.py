"""What a 256 MiB logits budget costs cuBLAS: the three GEMMs of the chunked path (logits,
dW addmm, dH with a float32 output) over the default chunks of the counted rows, against the
same three GEMMs once over all counted rows (what a peer that keeps every logit runs), per
GEMM. No softmax work. bf16, 8192 tokens, 10 % ignored (7373 counted rows); median of 10,
the two schedules alternated twice in one process."""
import json, math, os, torch
from fused_ce_patch.backends.triton import default_budget

torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
SHAPES = {"llama3-8b": (4096, 128256), "gemma2-2b": (2304, 256000),
          "qwen2.5-7b": (3584, 152064), "llama2-7b": (4096, 32000)}
M = 7373


def timed(fn, n=10, w=2):
    for _ in range(w):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * n)]
    out = []
    for i in range(n):
        ev[2 * i].record(); fn(); ev[2 * i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[2 * i].elapsed_time(ev[2 * i + 1]) for i in range(n))[n // 2]


res = {}
for name, (H, V) in SHAPES.items():
    torch.manual_seed(0)
    per_row = V * 2 + H * (2 + 4)
    rows_max = default_budget(M) // per_row
    n_chunks = math.ceil(M / rows_max)
    rows = math.ceil(M / n_chunks)
    h = torch.randn(M, H, device=dev).bfloat16()
    W = (torch.randn(V, H, device=dev) * H ** -0.5).bfloat16()
    dW = torch.empty(V, H, device=dev, dtype=torch.bfloat16)
    dH = torch.empty(M, H, device=dev, dtype=torch.float32)
    zc = torch.empty(rows, V, device=dev, dtype=torch.bfloat16)
    bounds = [(s, min(M, s + rows)) for s in range(0, M, rows)]

    def chunked(which=("z", "w", "h")):
        for i, (s, e) in enumerate(bounds):
            z = zc[: e - s]
            if "z" in which:
                torch.mm(h[s:e], W.t(), out=z)
            if "w" in which:
                if i == 0:
                    torch.mm(z.t(), h[s:e], out=dW)
                else:
                    dW.addmm_(z.t(), h[s:e])
            if "h" in which:
                torch.mm(z, W, out_dtype=torch.float32, out=dH[s:e])

    zw = torch.empty(M, V, device=dev, dtype=torch.bfloat16)

    def whole(which=("z", "w", "h")):
        if "z" in which:
            torch.mm(h, W.t(), out=zw)
        if "w" in which:
            torch.mm(zw.t(), h, out=dW)
        if "h" in which:
            torch.mm(zw, W, out_dtype=torch.float32, out=dH)

    zc.normal_(0, 1e-3); zw.normal_(0, 1e-3)
    row = {"rows_per_chunk": rows, "chunks": n_chunks}
    for rep in range(2):
        for key, fn in (("chunked", chunked), ("whole", whole)):
            row.setdefault(key, []).append(round(timed(fn), 3))
            for g in ("z", "w", "h"):
                row.setdefault(f"{key}_{g}", []).append(round(timed(lambda: fn((g,))), 3))
    res[name] = row
    print(name, json.dumps(row), flush=True)
    del h, W, dW, dH, zc, zw
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "budget_gemms.json"), "w"), indent=1)

"""Chunk widths of the counted-rows pass and the tail loop beyond H / slots (their buffer is
dW's free rows, not dH's storage): current rule vs L2 cap only vs fixed widths. Median of 5
after a warm-up, variants alternated twice in one process."""
import json, os, sys, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_bench
from fused_ce_patch import fused_linear_cross_entropy as flce
from fused_ce_patch.backends.triton import zero_logits_inplace as zi

def t(fn, n=5):
    fn(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn(); ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))[n // 2]

rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
orig_width = zi._chunk_width
def wide_width(rows, hsize, device, slots=2):
    return zi.chunk_cols(rows, device, 2 * slots)
out = {"env": gpu_bench.environment(torch, "cuda"), "rows": {}}
print(json.dumps(out["env"]), flush=True)
for name in ["gemma3-270m", "gemma2-2b", "qwen2.5-7b"]:
    n, H, V, cap = gpu_bench.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    hid = data["hidden"].requires_grad_(); W = data["weight"].requires_grad_(); y = data["labels"]
    spied = []
    orig_first = zi._first_pass_counted
    def spy(p, *a, **k):
        spied.append(p.compact); return orig_first(p, *a, **k)
    zi._first_pass_counted = spy
    def step():
        loss = flce(hid, W, y, softcap=cap, logits_budget=0, backend="triton")
        return (loss.detach(), *torch.autograd.grad(loss, (hid, W)))
    row, res = {}, {}
    for rep in ("", "2"):
        for tag, widthfn, cols in [("base", orig_width, None), ("wide-l2", wide_width, None),
                                   ("wide-2048", wide_width, 2048), ("wide-4096", wide_width, 4096)]:
            zi._chunk_width, zi.MAX_CHUNK_COLS = widthfn, cols
            try:
                res.setdefault(tag, step())
                row[tag + rep] = t(step)
            except Exception as e:
                row[tag + rep] = repr(e)[:200]
    zi._chunk_width, zi.MAX_CHUNK_COLS = orig_width, None
    zi._first_pass_counted = orig_first
    row["compact_pass"] = bool(spied) and all(spied)
    row["rel_vs_base"] = {k: [rel(a, b) for a, b in zip(v, res["base"])] for k, v in res.items()
                          if k != "base"}
    out["rows"][name] = row
    print(name, json.dumps(row), flush=True)
    del data, hid, W, res
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "wide.json"), "w"), indent=1)

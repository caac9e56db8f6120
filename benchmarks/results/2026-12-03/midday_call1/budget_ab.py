"""ours-sft (fused_linear_token_stats, entropy + top-1, ForwardGradHint) at the default budget
(TRL's tile, 256 MiB) vs an explicit 512 MiB / 1 GiB of logits per chunk, TRL's SFT head
beside; fwd+bwd ms (median of 7, alternated twice) and peak extra MiB beyond dH, dW."""
import json, os, sys, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_bench, gpu_trl_head
from trl_head_impls import build
from fused_ce_patch import ForwardGradHint, fused_linear_token_stats
def t(fn, n=7):
    fn(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn(); ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))[n // 2]
out = {}
for name in ("gemma2-2b", "gemma3-270m", "llama3-8b"):
    n, H, V, cap = gpu_trl_head.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    hid = data["hidden"].clone().requires_grad_(); W = data["weight"].clone().requires_grad_(); y = data["labels"]
    row = {}
    trl = build(torch, "trl-sft", cap)
    def mk(budget):
        hint = ForwardGradHint()
        def step():
            s = fused_linear_token_stats(hid, W, y, softcap=cap, entropy=True, accuracy=True, grad_hint=hint, logits_budget=budget)
            loss = -s.log_probs.sum() / s.mask.sum()
            return torch.autograd.grad(loss, (hid, W))
        return step
    row["trl-sft"] = round(t(lambda: torch.autograd.grad(trl(hid, W, y), (hid, W))), 2)
    for rep in ("", "2"):
        for label, budget in (("default", None), ("512MiB", 512 * 2**20), ("1GiB", 2**30)):
            step = mk(budget)
            row[f"{label}{rep}"] = round(t(step), 2)
            if rep == "":
                torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()
                g = step(); torch.cuda.synchronize()
                row[f"{label}-extra_mib"] = round((torch.cuda.max_memory_allocated() - before - sum(x.numel() * 2 for x in g)) / 2**20)
                del g
    out[name] = row
    print(name, json.dumps(row), flush=True)
    del data, hid, W
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "budget_ab.json"), "w"), indent=1)

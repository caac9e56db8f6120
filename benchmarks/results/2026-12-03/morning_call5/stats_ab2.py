"""Per-token SFT head: the entropy from the gradient pass (ENTROPY_IN_GRAD, the code now) vs
from the statistics pass (the kernel of call 4: seg_stats_kernels.py, same launch config), in
the same process, at gpu_trl_head's five shapes; TRL 1.16's SFT head once per shape. fwd+bwd,
median of 7 after a warm-up, variants alternated twice."""
import json, os, sys, time, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
sys.path.insert(0, os.path.join(os.getcwd(), ".gpu_probe"))
import gpu_bench, gpu_trl_head
from trl_head_impls import build, reference_weighted
from fused_ce_patch.backends.triton import token_stats as ts
from fused_ce_patch.backends.triton.launch import row_kernel_config
import seg_stats_kernels as old
from fused_ce_patch.backends.triton.launch import stats_kernel_config

NEW_LAUNCH = ts._launch

def old_launch(z, labels, out, coef, *, stats, grad, extras, transform, g_lp=None,
               g_lp_value=0.0, g_ent=None):
    r, vocab = z.shape
    if r == 0:
        return
    cfg = stats_kernel_config(vocab, z.device, transform.softcap is not None)
    mx, log_s, nll, ent, top1, mean, sq = out
    dummy = mx
    old.token_stats_row_kernel[(r,)](
        z, z.stride(0), labels, mx, log_s, nll,
        ent if ent is not None else dummy, top1 if top1 is not None else dummy,
        mean if mean is not None else dummy, sq if sq is not None else dummy,
        coef if coef is not None else dummy, g_lp if g_lp is not None else dummy,
        float(g_lp_value), g_ent if g_ent is not None else dummy,
        vocab, float(transform.logit_scale), float(transform.softcap or 1.0),
        float(transform.temperature),
        HAS_SOFTCAP=transform.softcap is not None, STATS=stats,
        ENTROPY=stats and "entropy" in extras, TOP1=stats and "is_top1" in extras,
        MEAN=stats and "mean_logits" in extras, SQ=stats and "log_sum_sq_probs" in extras,
        GRAD=grad, G_LP=0 if not grad else (2 if g_lp is not None else 1),
        G_ENT=grad and g_ent is not None, BLOCK_V=cfg.block_v, FIX_RNE=False,
        NUM_STAGES=cfg.num_stages, SUB_ROWS=cfg.sub_rows, FAST_MATH=cfg.fast_math,
        num_warps=cfg.num_warps)

def t(fn, n=7):
    fn(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn(); ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))[n // 2]

rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
torch.backends.cuda.matmul.allow_tf32 = False
out = {"env": gpu_bench.environment(torch, "cuda"), "rows": {}}
print(json.dumps(out["env"]), flush=True)
shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else list(gpu_trl_head.SHAPES)
for name in shapes:
    n, H, V, cap = gpu_trl_head.SHAPES[name]
    data = gpu_bench.make_inputs(torch, n, H, V, "cuda")
    refs = {False: gpu_bench.reference(torch, data, cap), True: reference_weighted(torch, data, cap)}
    hid = data["hidden"].clone().requires_grad_(); W = data["weight"].clone().requires_grad_()
    y = data["labels"]
    row = {}
    fns = {impl: build(torch, impl, cap) for impl in ("trl-sft", "ours-sft", "ours-logp", "ours-grpo")}
    def mk(fn):
        def step():
            loss = fn(hid, W, y)
            return (loss.detach(), *torch.autograd.grad(loss, (hid, W)))
        return step
    try:
        row["trl-sft"] = round(t(mk(fns["trl-sft"])), 2)
    except Exception as exc:
        row["trl-sft"] = f"error {exc}"[:200]
    for impl in ("ours-sft",):
        step = mk(fns[impl])
        ref = refs[impl.endswith("grpo")]
        for rep in ("", "2"):
            for var, launch in (("new", NEW_LAUNCH), ("seg", old_launch)):
                ts._launch = launch
                if rep == "":
                    got = step()
                    row[f"{impl}-{var}-err"] = [f"{rel(a, b):.2e}" for a, b in zip(got, (ref["loss"], ref["dh"], ref["dw"]))]
                    row.setdefault(f"{impl}-res", {})[var] = got
                row[f"{impl}-{var}{rep}"] = round(t(step), 2)
        res = row.pop(f"{impl}-res")
        row[f"{impl}-new-vs-seg"] = [f"{rel(a, b):.1e}" for a, b in zip(res["new"], res["seg"])]
        ts._launch = NEW_LAUNCH
    out["rows"][name] = row
    print(name, json.dumps(row), flush=True)
    del data, refs, hid, W, fns
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "stats_ab2.json"), "w"), indent=1)

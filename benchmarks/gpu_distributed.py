"""One training step on 2 GPUs through accelerate (DDP, FSDP2, DeepSpeed ZeRO-3): stock vs patched.

Question (issue 13): with the architectures of SmolLM2-135M and Qwen2.5-0.5B (both with tied
embeddings) at 2 x 4096 tokens per GPU, under accelerate's DDP, FSDP2 (``fsdp_version=2``;
accelerate 1.15 puts ``lm_head`` in a unit of its own with the final norm, and with the
embedding when tied) and DeepSpeed ZeRO-3 (``DeepSpeedPlugin(zero_stage=3)``), does
``apply_fused_ce`` give the stock loss (within bf16 tolerance) and the stock gathered lm_head
gradient (within 1e-2 relative), and what do step time and peak memory per GPU become? And for
Gemma-3-270M at 8 x 4096 tokens per GPU under FSDP2: stock vs patched vs Liger's loss-only patch.

How: the parent process starts one ``torchrun --nproc-per-node 2`` per group of runs (per mode
for stock + patched, and a separate one for Liger, whose class patches must not leak into other
runs); each run inside it builds the model from ``e2e_configs/<model>.json`` with seeded random
bf16 weights (same seed on every rank and variant), patches it (or not), prepares it with a fresh
``Accelerator(mixed_precision="bf16")`` (FSDP2: fp32 sharded master weights, bf16 compute;
ZeRO-3: bf16 parameters, fp32 optimizer partitions; DDP: bf16 parameters under autocast) and a
torch AdamW, then

1. step 1: forward + backward on this rank's rows of one fixed batch (first ``seq // 16``
   labels of each row ignored, so every rank counts the same tokens); the gathered gradient of
   ``get_output_embeddings().weight`` (FSDP2: ``DTensor.full_tensor()``, ZeRO-3:
   ``deepspeed.utils.safe_get_full_grad``, DDP: the all-reduced ``.grad``) is saved by rank 0
   in float32 to a scratch folder (not ``--out``: up to 0.7 GB each); the loss is averaged over
   ranks; then the optimizer steps;
2. ``--warmup`` more steps, then ``--steps`` timed steps (forward, backward, optimizer step;
   CUDA events), peak = ``torch.cuda.max_memory_allocated`` over the timed steps.

Reported per run: loss of step 1, relative difference to the stock run's loss of the same
(model, mode), ``|g - g_stock| / |g_stock|`` of the gathered head gradient (tied heads: the
embedding's gradient, which includes the head's), step ms (median over the timed steps, max over
ranks), peak GiB (max over ranks), memory still allocated when the run started (leak check:
runs of one group share a process), and how the head was sharded. Checks: loss within 2^-7
relative (one bf16 spacing: under FSDP2, accelerate's ``MixedPrecisionPolicy(output_dtype=bf16)``
rounds each rank's loss to bf16, stock and patched alike), gradient within 1e-2.

Writes ``gpu_distributed.json`` under ``--out`` and prints a markdown table. Each group's
torchrun output goes to ``--out``/``gpu_distributed_<group>.log``.

``--tiny``: a CPU dry run with gloo and 2 processes, 2-layer models of the same families with
small widths and vocabularies, 2 x 64 tokens, backend ``torch``. It covers DDP (accelerate's
``MULTI_CPU``), FSDP2 through accelerate's own ``fsdp2_prepare_model`` (accelerate 1.15 drops
its FSDP plugin without accelerators, so the function is called with a stand-in holding the
same plugin: same units, including the head's) and, when ``deepspeed`` is importable,
ZeRO-3 through accelerate's ``DeepSpeedPlugin`` (``DS_ACCELERATOR=cpu``). Liger is skipped
(needs CUDA). Timings and memory of a tiny run mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import time_ms  # noqa: E402  (the timer of every benchmark)
ROOT = os.path.dirname(HERE)
#: model -> (config file in e2e_configs/, decoder layer class for accelerate's wrap policy)
MODELS = {
    "smollm2-135m": ("smollm2-135m.json", "LlamaDecoderLayer"),
    "qwen2.5-0.5b": ("qwen2.5-0.5b.json", "Qwen2DecoderLayer"),
    "gemma3-270m": ("gemma3-270m.json", "Gemma3DecoderLayer"),
}
MODES = ("ddp", "fsdp2", "zero3")
VARIANTS = ("stock", "patched", "liger")
#: Loss: one bf16 spacing (accelerate's FSDP2 policy has output_dtype=bf16, so each rank's
#: loss is rounded to bf16 there); gradient: the issue's 1e-2.
LOSS_RTOL, GRAD_RTOL = 2.0**-7, 1e-2
#: The issue's plan: (models, modes, variants, rows per GPU). Stock runs before its variants.
PLAN = (
    (("smollm2-135m", "qwen2.5-0.5b"), MODES, ("stock", "patched"), 2),
    (("gemma3-270m",), ("fsdp2",), ("stock", "patched", "liger"), 8),
)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES), help="subset of ddp,fsdp2,zero3")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--group-timeout", type=float, default=200.0,
                   help="seconds one torchrun group may take before it is killed")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole script (default 280, --tiny 1800); a group that "
                        "would start with less than 20 s left is skipped, so the table is written")
    p.add_argument("--tiny", action="store_true", help="CPU/gloo dry run (see the docstring)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # plan file of a group
    args = p.parse_args()
    if args.tiny:
        args.seq, args.steps, args.warmup = 64, 2, 1
    if args.budget is None:
        args.budget = 1800.0 if args.tiny else 280.0
    if args.worker:
        return worker(args)
    return parent(args)


# ----------------------------------------------------------------------------- parent


def groups(args):
    """Runs grouped into torchrun launches: one per mode for stock + patched; Liger alone."""
    models, modes = args.models.split(","), args.modes.split(",")
    for m in models + modes:
        if m not in MODELS and m not in MODES:
            raise SystemExit(f"unknown model or mode {m!r}")
    runs = []
    for plan_models, plan_modes, variants, rows in PLAN:
        for mode in plan_modes:
            for model in plan_models:
                for variant in variants:
                    if model in models and mode in modes:
                        runs.append({"model": model, "mode": mode, "variant": variant,
                                     "rows": 1 if args.tiny else rows})
    out = {}
    for r in runs:
        key = "liger" if r["variant"] == "liger" else r["mode"]
        out.setdefault(key, []).append(r)
    return out


def parent(args):
    import torch

    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="gpu_distributed_")
    env = environment(torch, args)
    print(json.dumps(env), flush=True)
    rows = []
    deadline = time.time() + args.budget - 30  # 30 s kept for the comparisons and the table
    try:
        for name, runs in groups(args).items():
            left = deadline - time.time()
            if left < 20:
                rows += [{**r, "error": "skipped: out of the time budget"} for r in runs]
                continue
            rows += launch(name, runs, args, scratch, min(args.group_timeout, left))
        compare(torch, rows, scratch)
        env["devices"] = sorted({r["device"] for r in rows if "device" in r})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    with open(os.path.join(args.out, "gpu_distributed.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(table(rows, env))


def environment(torch, args):
    import accelerate
    import transformers

    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": sys.version.split()[0],
           "torch": torch.__version__, "transformers": transformers.__version__,
           "accelerate": accelerate.__version__, "seq": args.seq, "steps": args.steps,
           "warmup": args.warmup, "tiny": args.tiny, "world": 2}
    from importlib import metadata

    for pkg in ("deepspeed", "liger_kernel", "triton"):
        try:
            __import__(pkg)
            env[pkg] = metadata.version(pkg)
        except Exception as exc:  # not installed / not importable here: say so
            env[pkg] = f"unavailable ({type(exc).__name__})"
    return env  # the devices come from the workers (no CUDA context in this process)


def launch(name, runs, args, scratch, timeout):
    """One torchrun with 2 processes for ``runs``; returns their rows (errors included)."""
    plan = os.path.join(scratch, f"{name}.plan.json")
    results = os.path.join(scratch, f"{name}.jsonl")
    with open(plan, "w") as f:
        json.dump({"runs": runs, "scratch": scratch, "results": results}, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.abspath(__file__), "--worker", plan, "--seq", str(args.seq),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.tiny:
        cmd.append("--tiny")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (device machine's rule)
    env.setdefault("OMP_NUM_THREADS", "1" if args.tiny else "4")
    if args.tiny:
        env.update(TRITON_INTERPRET="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    log = os.path.join(args.out, f"gpu_distributed_{name}.log")
    t0 = time.time()
    print(f"=== group {name}: {len(runs)} runs", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # its own group: killed as a whole
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    print(f"=== group {name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
    got, errors = {}, {}
    if os.path.exists(results):
        with open(results) as f:
            for line in f:
                r = json.loads(line)
                key = (r["model"], r["mode"], r["variant"])
                if "error" in r:  # any rank's error wins over rank 0's numbers
                    errors.setdefault(key, r)
                else:
                    got[key] = r
    got.update(errors)
    rows = []
    for run in runs:
        key = (run["model"], run["mode"], run["variant"])
        row = got.get(key) or {**run, "error": f"no result (group exit {rc}; see {log})"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if rc != 0:
        with open(log) as f:
            print("".join(f.readlines()[-30:]), flush=True)
    return rows


def compare(torch, rows, scratch):
    """Loss and gathered-gradient differences of every variant to the stock run of its
    (model, mode); the gradients are read from the scratch files the workers saved."""
    stock = {(r["model"], r["mode"]): r for r in rows if r["variant"] == "stock"}
    for r in rows:
        ref = stock.get((r["model"], r["mode"]))
        if r["variant"] == "stock" or ref is None or "error" in r or "error" in ref:
            continue
        r["loss_rel"] = abs(r["loss"] - ref["loss"]) / abs(ref["loss"])
        a, b = (os.path.join(scratch, x["grad_file"]) for x in (r, ref))
        if os.path.exists(a) and os.path.exists(b):
            g, g0 = torch.load(a), torch.load(b)
            if g.shape != g0.shape:
                r["grad_rel"] = f"shape {tuple(g.shape)} vs {tuple(g0.shape)}"
                continue
            r["grad_rel"] = ((g.double() - g0.double()).norm() / g0.double().norm()).item()
        r["ok"] = r["loss_rel"] <= LOSS_RTOL and isinstance(r.get("grad_rel"), float) and (
            r["grad_rel"] <= GRAD_RTOL)


def table(rows, env):
    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else (v or "")

    lines = [
        f"{env['date']}; {', '.join(env['devices']) or '?'} x 2; torch {env['torch']}, "
        f"transformers {env['transformers']}, accelerate {env['accelerate']}, deepspeed "
        f"{env['deepspeed']}, liger-kernel {env['liger_kernel']}; 2 processes, "
        f"{env['seq']} tokens per row",
        "",
        "| model | mode | variant | rows/GPU | head unit | loss | loss rel. diff "
        "| lm_head grad rel. err | step ms | peak GiB/GPU | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['mode']} | {r['variant']} | {r.get('rows', '')} |"
        if "error" in r:
            lines.append(f"{head} | {r['error'][:160]} | | | | | | |")
            continue
        ok = "" if r["variant"] == "stock" else ("yes" if r.get("ok") else "**no**")
        lines.append(
            f"{head} {r['head_unit']} | {r['loss']:.4f} | {num(r.get('loss_rel'), '.1e')} | "
            f"{num(r.get('grad_rel'), '.1e')} | {r['ms']:.1f} | {r['peak_gib']:.2f} | {ok} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- worker


def worker(args):
    import datetime

    import torch
    import torch.distributed as dist

    with open(args.worker) as f:
        plan = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    cuda = not args.tiny
    if cuda:
        torch.cuda.set_device(local)
    if any(r["mode"] == "zero3" for r in plan["runs"]):
        try:  # deepspeed's Tensor patches must not meet a first torch._dynamo import
            import torch._dynamo  # noqa: F401
        except ImportError:
            pass
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(seconds=120 if cuda else 300))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    try:
        for run in plan["runs"]:
            t0 = time.time()
            env = dict(os.environ)  # accelerate exports ACCELERATE_USE_FSDP/_DEEPSPEED for good
            try:
                row = one_run(torch, dist, run, args, device, plan["scratch"])
            except Exception as exc:
                oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc)
                if not oom:
                    traceback.print_exc()
                row = {"error": "OOM" if oom else f"{type(exc).__name__}: {exc}"[:400],
                       "rank": rank}
            finally:
                from accelerate.state import AcceleratorState

                AcceleratorState._reset_state(True)
                os.environ.clear()
                os.environ.update(env)
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            if rank == 0 or "error" in row:
                row = {**run, **row, "wall_s": round(time.time() - t0, 1)}
                with open(plan["results"], "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()


def build(torch, name, args, device):
    """Seeded random bf16 weights in the model's real architecture (tiny: 2 narrow layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(os.path.join(HERE, "e2e_configs", MODELS[name][0]))
    if args.tiny:
        config.num_hidden_layers = 2
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:2]
        kv = config.num_key_value_heads
        config.update({"hidden_size": 64, "intermediate_size": 128, "vocab_size": 509,
                       "num_attention_heads": 2 * kv, "head_dim": 16})
        if getattr(config, "sliding_window", None):
            config.sliding_window = 16
        if hasattr(config, "query_pre_attn_scalar"):
            config.query_pre_attn_scalar = 16
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: fast, and equal on every rank
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")  # fmt: skip
    return model.train()


def patch(model, name, variant, args):
    if variant == "patched":
        from fused_ce_patch import apply_fused_ce

        apply_fused_ce(model, backend="torch" if args.tiny else None)
    elif variant == "liger":
        if args.tiny:
            raise RuntimeError("skipped: Liger needs CUDA")
        try:
            from liger_kernel.transformers import monkey_patch as lk
        except ImportError as exc:
            raise RuntimeError(f"skipped: liger_kernel not importable ({exc})") from None
        if name != "gemma3-270m":
            raise ValueError(f"no Liger variant for {name}")
        # loss only: every other Liger kernel off
        lk.apply_liger_kernel_to_gemma3_text(rope=False, cross_entropy=False, rms_norm=False,
                                             fused_linear_cross_entropy=True, geglu=False,
                                             model=model)  # fmt: skip


def prepare(torch, model, run, args, device):
    """``(model, optimizer, accelerator, engine)`` for the run's mode (engine: DeepSpeed only)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    mode, world = run["mode"], int(os.environ["WORLD_SIZE"])
    layer_cls = MODELS[run["model"]][1]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if mode == "ddp":
        acc = Accelerator(mixed_precision="bf16", cpu=args.tiny)
        expected = "MULTI_CPU" if args.tiny else "MULTI_GPU"
    elif mode == "fsdp2":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=[layer_cls], reshard_after_forward=True,
        )
        if args.tiny:  # accelerate drops FSDP without accelerators: its own function, stand-in
            return (*fsdp2_on_cpu(torch, model, plugin), None, None)
        acc = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin)
        expected = "FSDP"
    elif mode == "zero3":
        plugin = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=1,
                                 zero3_init_flag=False)  # fmt: skip
        cfg = plugin.deepspeed_config
        cfg["train_micro_batch_size_per_gpu"] = run["rows"]
        cfg["train_batch_size"] = run["rows"] * world
        cfg["zero_allow_untested_optimizer"] = True
        if args.tiny:  # tiny weights are under ZeRO-3's default threshold for kept-whole ones
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        acc = Accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
        expected = "DEEPSPEED"
    else:
        raise ValueError(f"unknown mode {mode!r}")
    if acc.distributed_type.name != expected:
        raise RuntimeError(f"accelerate prepared {acc.distributed_type.name}, not {expected}")
    model, opt = acc.prepare(model, opt)
    return model, opt, acc, model if mode == "zero3" else None


def fsdp2_on_cpu(torch, model, plugin):
    """accelerate's ``fsdp2_prepare_model`` on CPU processes, through a stand-in accelerator
    that holds the plugin (bf16 mixed precision as on the GPU); then a fresh AdamW."""
    from types import SimpleNamespace

    from accelerate import PartialState
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    PartialState(cpu=True)  # accelerate's logging needs a state
    plugin.set_mixed_precision("bf16", override=True)
    stand_in = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16",
        is_main_process=int(os.environ["RANK"]) == 0, torch_device_mesh=None,
        parallelism_config=None, device=torch.device("cpu"),
    )
    model = fsdp2_prepare_model(stand_in, model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5)


def unwrapped(model):
    """The model inside a DDP / DeepSpeed-engine wrapper (FSDP2 shards in place)."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def head_of(model):
    return unwrapped(model).get_output_embeddings()


def head_unit(model) -> str:
    from torch.distributed.fsdp import FSDPModule

    head = head_of(model)
    if isinstance(head, FSDPModule):
        modules = getattr(head._get_fsdp_state(), "_modules", (head,))  # the unit's modules
        names = sorted(type(m).__name__ for m in modules)
        names = [n.removeprefix("FSDP") for n in names]
        return "fsdp2 unit " + "+".join(names) if len(names) > 1 else "fsdp2 own unit"
    if hasattr(head.weight, "ds_id"):
        return "zero3 partitioned" if not head.weight.ds_persist else "zero3 persistent"
    return "replicated" if not hasattr(head.weight, "full_tensor") else "fsdp2 root unit"


def gathered_head_grad(model, mode):
    """The full gradient of the head's weight, on every rank (a collective)."""
    weight = head_of(model).weight
    if mode == "zero3":
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(weight)
    grad = weight.grad
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def one_run(torch, dist, run, args, device, scratch):
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    base = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    model = build(torch, run["model"], args, device)
    # FSDP2 and ZeRO-3 shard each rank's own copy: the seeded weights must agree across ranks.
    probe = torch.stack([p.detach().double().sum() for p in model.parameters()])
    low, high = probe.clone(), probe.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise RuntimeError("seeded weights differ across ranks")
    patch(model, run["model"], run["variant"], args)
    model, opt, acc, engine = prepare(torch, model, run, args, device)
    unit = head_unit(model)

    rows = run["rows"]
    g = torch.Generator().manual_seed(1)  # one batch, each rank its own rows
    vocab = unwrapped(model).config.vocab_size
    ids = torch.randint(0, vocab, (rows * world, args.seq), generator=g)[rank * rows:][:rows]
    labels = ids.clone()
    labels[:, : args.seq // 16] = -100  # a prompt part, same count on every rank
    ids, labels = ids.to(device), labels.to(device)

    def backward(loss):
        if acc is None:
            loss.backward()
        else:
            acc.backward(loss)  # DeepSpeed: engine.backward + engine.step

    def step():
        loss = model(input_ids=ids, labels=labels).loss
        backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    # Step 1: gradient read between backward and the optimizer step.
    loss = model(input_ids=ids, labels=labels).loss
    if engine is not None:
        engine.backward(loss)
    else:
        backward(loss)
    grad = gathered_head_grad(model, run["mode"])
    grad_file = f"{run['model']}-{run['mode']}-{run['variant']}.pt"
    if rank == 0:
        torch.save(grad.detach().float().cpu(), os.path.join(scratch, grad_file))
    del grad
    if engine is not None:
        engine.step()
    else:
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss = loss.detach().float().reshape(1)
    dist.all_reduce(loss)
    first_loss = loss.item() / world

    timing = time_ms(step, iters=args.steps, warmup=args.warmup, device=device, track_peak=cuda)
    times, peak = timing.ms, timing.peak_bytes / 2**30 if cuda else 0.0
    stats = torch.tensor([timing.median, peak, base], dtype=torch.float64,
                         device=device)  # fmt: skip
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if engine is not None:
        engine.destroy()
    del model, opt, acc, engine
    return {"loss": first_loss, "ms": stats[0].item(), "ms_rank0": times,
            "peak_gib": stats[1].item(), "base_gib": stats[2].item(), "head_unit": unit,
            "grad_file": grad_file,
            "device": torch.cuda.get_device_name(device) if cuda else "CPU (tiny)"}


if __name__ == "__main__":
    sys.exit(main())

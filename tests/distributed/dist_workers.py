"""Worker side of the distributed tests (spawned by test_distributed.py): CPU processes and
gloo by default; one GPU per process and NCCL with ``FUSED_CE_DIST_DEVICE=cuda`` (needs
``WORLD`` GPUs; DeepSpeed then runs on its CUDA accelerator instead of ``DS_ACCELERATOR=cpu``).

Each worker builds the same tiny Llama (seed 0), patches it with the fused loss (``torch``
backend, spied), wraps it in one distributed mode, runs one forward/backward on its half of a
fixed batch, and rank 0 saves the averaged loss, the full (gathered) gradient of every
parameter and what the spy saw. Both halves hold the same number of counted tokens, so the mean
of the per-rank mean losses (and the averaged gradients) equal one process on the whole batch.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist
from torch import nn

VOCAB, HIDDEN, BATCH, SEQ, WORLD, LORA_RANK = 211, 32, 4, 9, 2, 4
#: Where the workers run: "cpu" (gloo, the default) or "cuda" (NCCL, GPU ``rank`` each). Models
#: are built (and PEFT-wrapped) on the CPU with the same seeds as the single-process reference,
#: then moved, so both see the same weights; results are saved on the CPU.
DEVICE = os.environ.get("FUSED_CE_DIST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"FUSED_CE_DIST_DEVICE must be 'cpu' or 'cuda', not {DEVICE!r}")
CUDA = DEVICE == "cuda"
MODES = ("ddp", "fsdp2_root", "fsdp2_head", "fsdp2_tied", "fsdp1_head", "fsdp2_lora_head",
         "fsdp2_head_late", "fsdp1_head_late")
#: Through accelerate, a plain prepare/backward loop: DDP, and FSDP2 as accelerate 1.15 shards
#: (layers, the head in a unit with the final norm, and with the embedding when tied; on CPU
#: processes through its ``fsdp2_prepare_model``, see accelerate_prepare).
ACCELERATE_MODES = ("acc_ddp", "acc_fsdp2", "acc_fsdp2_tied")
#: DeepSpeed (needs the deepspeed package; DS_ACCELERATOR=cpu): ZeRO-2 and ZeRO-3 through
#: accelerate's DeepSpeedPlugin, and ZeRO-3 through deepspeed.initialize.
DEEPSPEED_MODES = ("acc_zero2", "acc_zero3", "ds_zero3")
#: transformers Trainer with the flag and FusedCECallback (one SGD step; gradients are read
#: back from the weight change). Trainer `fsdp=` cannot run on CPU (see accelerate_prepare),
#: nor Trainer `deepspeed=`: without an accelerator, accelerate 1.15's PartialState counts one
#: process when DeepSpeed is on, and Trainer's batch-size bookkeeping then disagrees with
#: DeepSpeed's ("train_batch_size ... mismatch").
TRAINER_MODES = ("trainer_ddp",)
TRAINER_LR = 100.0
#: Partition every parameter: by default ZeRO-3 keeps small ones (< 1e5 elements) whole.
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
#: Modes that must raise: the head's weight would be read as a shard.
REFUSED = ("fsdp2_head_unhooked",)


def build(tied: bool, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager", tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.train()
    return model


def build_for(mode: str):
    """The model of ``mode``: tied for ``*_tied``, PEFT LoRA on lm_head for ``*_lora_*``."""
    model = build(tied="tied" in mode)
    if "lora" in mode:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(2)  # random A and B (init_lora_weights=False): both get gradients
        cfg = LoraConfig(r=LORA_RANK, lora_alpha=8, lora_dropout=0.0, target_modules=["lm_head"],
                         init_lora_weights=False)
        model = get_peft_model(model, cfg)
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, ids.clone()  # no ignored label: both halves count the same number of tokens


def device() -> torch.device:
    """This worker's device: its GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")


def clean(name: str) -> str:
    for junk in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(junk, "")
    return name


class BackendSpy:
    """Counts calls of the torch backend and records the weight shape each call saw."""

    def __init__(self):
        from fused_ce_patch import backends

        self.impl = backends.get_backend("torch")
        self.shapes = []
        original = type(self.impl).run

        def run(impl, problem):
            self.shapes.append(tuple(problem.weight.shape))
            return original(impl, problem)

        self.impl.run = run.__get__(self.impl)

    def close(self):
        del self.impl.run


def wrap(model, mode):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[torch.cuda.current_device()] if CUDA else None)
    if mode.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
        causal_lm = model.get_base_model() if "lora" in mode else model
        for layer in causal_lm.model.layers:
            fully_shard(layer, mesh=mesh)
        if mode.startswith("fsdp2_head") or mode == "fsdp2_lora_head":
            fully_shard(causal_lm.lm_head, mesh=mesh)  # the head as its own unit
        if mode == "fsdp2_head_unhooked":  # a head whose gathering hooks were taken away
            model.lm_head._forward_pre_hooks.clear()
            model.lm_head._forward_hooks.clear()
        fully_shard(model, mesh=mesh)
        return model
    if mode == "fsdp1_head":
        import functools

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        head = model.lm_head
        policy = functools.partial(
            lambda_auto_wrap_policy,
            lambda_fn=lambda m: m is head or isinstance(m, LlamaDecoderLayer),
        )
        return FSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=device())
    raise ValueError(mode)


def accelerate_prepare(model, mode):
    """``accelerator.prepare`` for ``mode``; returns (model, accelerator or None).

    FSDP through accelerate's Accelerator cannot run on CPU processes: accelerate 1.15 turns its
    FSDP plugin on only for multi-accelerator runs, and prepares plain DDP instead (checked
    below). There FSDP2 modes call accelerate's own ``fsdp2_prepare_model`` with a stand-in
    accelerator holding the plugin (what ``prepare`` calls on GPUs), and backward is plain.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # one Accelerator per mode in this process
    if "fsdp2" in mode:
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )
        if CUDA:
            acc = Accelerator(fsdp_plugin=plugin)
            assert acc.distributed_type.name == "FSDP", acc.distributed_type
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            model, _ = acc.prepare(model, opt)
            return model, acc
        from types import SimpleNamespace

        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        state = PartialState(cpu=True)  # accelerate's logging needs one
        stand_in = SimpleNamespace(
            state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
            is_main_process=state.is_main_process, torch_device_mesh=None,
            parallelism_config=None, device=torch.device("cpu"),
        )
        return fsdp2_prepare_model(stand_in, model), None
    ds_plugin = None
    if "zero" in mode:
        from accelerate.utils import DeepSpeedPlugin

        ds_plugin = DeepSpeedPlugin(zero_stage=int(mode[-1]), gradient_accumulation_steps=1)
        ds_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = BATCH // WORLD
        ds_plugin.deepspeed_config["train_batch_size"] = BATCH
        ds_plugin.deepspeed_config["zero_allow_untested_optimizer"] = True
        if mode.endswith("zero3"):
            ds_plugin.deepspeed_config["zero_optimization"].update(ZERO3)
    # cpu=True would make accelerate drop a DeepSpeed plugin (plain DDP instead); without an
    # accelerator DeepSpeed runs on the CPU anyway (DS_ACCELERATOR=cpu).
    acc = Accelerator(cpu=ds_plugin is None and not CUDA, deepspeed_plugin=ds_plugin)
    expected = "DEEPSPEED" if ds_plugin is not None else ("MULTI_GPU" if CUDA else "MULTI_CPU")
    assert acc.distributed_type.name == expected, acc.distributed_type
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, _ = acc.prepare(model, opt)
    return model, acc


def head_kind(model) -> str:
    """How the head is wrapped: "fsdp1" / "fsdp2" when it is its own unit, else "plain"."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    head = [m for n, m in model.named_modules() if n.endswith("lm_head")][0]
    if isinstance(head, FullyShardedDataParallel):
        return "fsdp1"
    if hasattr(head.weight, "ds_id") and not head.weight.ds_persist:  # a ZeRO-3 partition
        return "zero3"
    return "fsdp2" if isinstance(head, FSDPModule) else "plain"


def deepspeed_initialize(model):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": BATCH // WORLD, "zero_allow_untested_optimizer": True,
              "zero_optimization": ZERO3}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def full_grads(model, mode):
    if "zero" in mode:
        from deepspeed.utils import safe_get_full_grad

        module = model.module
        return {clean(n): safe_get_full_grad(p).detach().cpu()
                for n, p in module.named_parameters()}
    if "fsdp1" in mode:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, with_grads=True):
            return {clean(n): p.grad.detach().cpu() for n, p in model.named_parameters()}
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is None:  # frozen (PEFT base weights)
            continue
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[clean(n)] = g.detach().cpu()
    return out


def run_trainer(rank, world, mode, out_dir):
    from transformers import Trainer

    from fused_ce_patch import FusedCECallback, FusedCETrainingArguments

    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    model = build(tied=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, labels = batch()
    rows = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]
    args = FusedCETrainingArguments(
        output_dir=os.path.join(out_dir, mode), use_fused_ce=True, fused_ce_backend="torch",
        per_device_train_batch_size=BATCH // world, max_steps=1, learning_rate=TRAINER_LR,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, dataloader_num_workers=0,
        use_cpu=not CUDA,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows,
                      callbacks=[FusedCECallback()])
    assert trainer.accelerator.distributed_type.name == ("MULTI_GPU" if CUDA else "MULTI_CPU")
    spy = BackendSpy()
    try:
        result = trainer.train()
    finally:
        spy.close()
    head_unit = head_kind(trainer.model_wrapped)
    after = {clean(n): p.detach().cpu() for n, p in trainer.model.named_parameters()}
    grads = {n: (before[n] - after[n]) / TRAINER_LR for n in before}
    if rank == 0:
        torch.save({"loss": torch.tensor(result.training_loss), "grads": grads,
                    "spy": spy.shapes, "head_unit": head_unit, "steps": 1},
                   os.path.join(out_dir, f"{mode}.pt"))
    dist.barrier()


def run_mode(rank, world, mode, out_dir):
    if mode.startswith("trainer_"):
        return run_trainer(rank, world, mode, out_dir)
    from fused_ce_patch import apply_fused_ce

    model = build_for(mode).to(device())
    name, late = mode, mode.endswith("_late")  # late: patch after wrapping (hooks in place)
    mode = mode.removesuffix("_late")
    if not late:
        apply_fused_ce(model, backend="torch")
    if mode.startswith("acc_"):
        model, acc = accelerate_prepare(model, mode)
        # accelerate's backward also steps a DeepSpeed engine (and frees the gradients):
        # call the engine's own backward to read the gradients of this one step.
        backward = model.backward if "zero" in mode else (
            acc.backward if acc is not None else torch.Tensor.backward)
    elif mode == "ds_zero3":
        model = deepspeed_initialize(model)
        backward = model.backward
    else:
        model = wrap(model, mode)
        backward = torch.Tensor.backward
    if late:
        apply_fused_ce(model, backend="torch")
    head_unit = head_kind(model)
    ids, labels = (t.to(device()) for t in batch())
    half = BATCH // world
    rows = slice(rank * half, (rank + 1) * half)
    # torch-native wrappers run the step twice (gradients cleared in between): the second
    # step shows the head's wrapper state survived the first (resharded, hooks re-armed).
    steps = 2 if name in MODES else 1
    spy = BackendSpy()
    try:
        for step in range(steps):
            if step:
                model.zero_grad(set_to_none=True)
            out = model(input_ids=ids[rows], labels=labels[rows])
            backward(out.loss)
    finally:
        spy.close()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    loss = loss.cpu() / world
    grads = full_grads(model, mode)
    if rank == 0:
        torch.save({"loss": loss, "grads": grads, "spy": spy.shapes, "head_unit": head_unit,
                    "steps": steps}, os.path.join(out_dir, f"{name}.pt"))
    dist.barrier()


def worker(rank, world, init_file, modes, out_dir):
    torch.set_num_threads(1)
    if CUDA:
        torch.cuda.set_device(rank)
    if any("zero" in m for m in modes):
        if not CUDA:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # deepspeed.zero.Init-style Tensor patches must not meet a first torch._dynamo import.
        importlib.import_module("torch._dynamo")
    # What torch.distributed.run exports; accelerate reads these (the group is made below).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    import datetime

    dist.init_process_group("nccl" if CUDA else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for mode in modes:
            env = dict(os.environ)  # accelerate exports ACCELERATE_USE_FSDP/_DEEPSPEED for good
            try:
                run_mode(rank, world, mode, out_dir)
            except Exception as exc:  # recorded for the test to report; other modes go on
                if rank == 0:
                    with open(os.path.join(out_dir, f"{mode}.err"), "w") as f:
                        import traceback

                        f.write("".join(traceback.format_exception(exc)))
                dist.barrier()
            finally:
                os.environ.clear()
                os.environ.update(env)
        dist.barrier()
        with open(os.path.join(out_dir, f"rank{rank}.done"), "w"):
            pass  # the test's spawn reads these: every mode of every rank finished
    finally:
        dist.destroy_process_group()

"""Worker side of test_tensor_parallel.py: each spawned rank loads the same tiny Llama with
transformers' own tensor parallelism (``from_pretrained(path, tp_plan="auto")``: lm_head a
``colwise_gather_output`` layer, its weight a ``DTensor`` split along the vocabulary), patched
or not, runs one training forward/backward on the whole batch (tensor-parallel ranks see the
same batch) and rank 0 saves the loss, every gradient gathered to a full tensor, and what the
spy on the vocabulary-parallel loss saw. CPU and gloo.

The ``trainer_*`` modes train the TP model with transformers' Trainer instead (a few SGD steps
with gradient accumulation, see :func:`run_trainer`); :func:`train` is shared with the test's
single-process reference."""

from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist

import dist_workers
import vp_workers
from vp_workers import leave

BATCH, SEQ = 4, 32
#: A budget of 8 whole rows of one rank's vocabulary shard in float32 (4 bytes a logit).
SMALL_BUDGET = 8 * 106 * 4
MODES = ("stock", "fused", "stock_items", "fused_items", "fused_budget", "fused_twice",
         "fused_tied")
#: 4 processes: transformers' own FSDP2 x TP (``DistributedConfig(tp_size=2, fsdp_size=2)``,
#: mesh (fsdp, tp)); each FSDP rank pair takes half of the batch.
FSDP_MODES = ("fsdp_stock", "fsdp_fused")
#: transformers' Trainer on the TP model: stock; the flag (``FusedCETrainingArguments(
#: use_fused_ce=True)``, which adds ``FusedCECallback``); ``apply_fused_ce(model)`` before
#: ``Trainer(...)`` with the stock arguments; and stock without :class:`_ParallelismOnCPU`,
#: which accelerate must refuse (the day it accepts CPU processes, the lift can go).
TRAINER_MODES = ("trainer_stock", "trainer_fused", "trainer_fused_pre", "trainer_unlifted")
#: Optimizer steps, micro-batches per step (gradient accumulation) and rows per micro-batch.
TRAINER_STEPS, TRAINER_ACCUM, TRAINER_MICRO = 4, 2, 2
TRAINER_LR = 2.0


def batch(ignored: bool):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, dist_workers.VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    if ignored:
        labels[:, :3] = -100
        labels[1, 7:] = -100
    return ids, labels


def call_kwargs(mode: str):
    ids, labels = batch(ignored="items" in mode)
    kwargs = {"input_ids": ids, "labels": labels}
    if "items" in mode:  # what Trainer passes: counted labels after the shift
        kwargs["num_items_in_batch"] = torch.tensor(int((labels[:, 1:] != -100).sum()) + 3)
    return kwargs


class VocabParallelSpy:
    """Records the local weight shard shape and budget of every vocabulary-parallel call (in
    ``calls``) and the ``num_items_in_batch`` it was given (in ``items``)."""

    def __init__(self):
        from fused_ce_patch.hf import head

        self.module, self.calls, self.items = head, [], []
        original = head.vocab_parallel_linear_cross_entropy

        def spy(hidden, weight_shard, labels, **kwargs):
            self.calls.append((tuple(weight_shard.shape), kwargs["vocab_start"],
                               kwargs.get("logits_budget")))
            items = kwargs.get("num_items_in_batch")
            self.items.append(float(items) if items is not None else None)
            return original(hidden, weight_shard, labels, **kwargs)

        self.original = original
        head.vocab_parallel_linear_cross_entropy = spy

    def close(self):
        self.module.vocab_parallel_linear_cross_entropy = self.original


def trainer_rows():
    """The training set: ``TRAINER_STEPS * TRAINER_ACCUM * TRAINER_MICRO`` rows of ``SEQ``
    tokens with ignored labels (a prefix and some tails of random length), so the micro-batches
    of a step count different numbers of tokens and ``num_items_in_batch`` changes the loss;
    the second micro-batch of the second step counts none (it adds nothing), and the last step
    counts none at all (``num_items_in_batch`` 0: stock's loss is 0 / 0 = NaN, its gradients
    0)."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for i in range(TRAINER_STEPS * TRAINER_ACCUM * TRAINER_MICRO):
        ids = torch.randint(0, dist_workers.VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        prefix, tail = torch.randint(1, 12, (2,), generator=g).tolist()
        labels[:prefix] = -100
        if i % 3 == 0:
            labels[SEQ - tail:] = -100
        micro, step = i // TRAINER_MICRO, i // (TRAINER_MICRO * TRAINER_ACCUM)
        if micro == TRAINER_ACCUM + 1 or step == TRAINER_STEPS - 1:
            labels[:] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def trainer_arguments(out_dir, fused: bool):
    """Trainer arguments: SGD, constant learning rate, no clipping, rows in order, a log entry
    (the unrounded mean loss of the step, NaN kept as NaN) every step. ``fused``: the flag's
    arguments."""
    from transformers import TrainingArguments

    from fused_ce_patch import FusedCETrainingArguments

    extra = {"use_fused_ce": True, "fused_ce_backend": "torch",
             "fused_ce_trust_compute_loss": True} if fused else {}  # RecordingTrainer calls super
    cls = FusedCETrainingArguments if fused else TrainingArguments
    return cls(
        output_dir=out_dir, per_device_train_batch_size=TRAINER_MICRO,
        gradient_accumulation_steps=TRAINER_ACCUM, max_steps=TRAINER_STEPS,
        learning_rate=TRAINER_LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, train_sampling_strategy="sequential", logging_steps=1,
        logging_nan_inf_filter=False, report_to=[],
        save_strategy="no", seed=0, dataloader_num_workers=0, use_cpu=True, **extra,
    )


def full(t):
    """``t`` whole: a ``DTensor`` gathered (a collective: every rank must call it), detached."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def train(model, args):
    """Trains ``model`` with a Trainer that records, per micro-batch, the input ids and the
    ``num_items_in_batch`` its ``compute_loss`` received, and per optimizer step the gradients
    the optimizer is about to apply. Returns (trainer, record) with those, the per-step logged
    losses and the full parameters after training."""
    from transformers import Trainer, TrainerCallback

    seen, grads = [], []

    class RecordingTrainer(Trainer):
        def compute_loss(self, model, inputs, *a, num_items_in_batch=None, **kw):
            items = None if num_items_in_batch is None else float(num_items_in_batch)
            seen.append((inputs["input_ids"].detach().cpu().clone(), items))
            return super().compute_loss(model, inputs, *a, num_items_in_batch=num_items_in_batch,
                                        **kw)

    class GradientRecorder(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: full(p.grad) for n, p in model.named_parameters()})

    trainer = RecordingTrainer(model=model, args=args, train_dataset=trainer_rows(),
                               callbacks=[GradientRecorder()])
    result = trainer.train()
    record = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "training_loss": result.training_loss, "batches": [b for b, _ in seen],
              "items": [n for _, n in seen], "grads": grads,
              "params": {n: full(p) for n, p in trainer.model.named_parameters()}}
    return trainer, record


class _ParallelismOnCPU:
    """Lets accelerate 1.15 accept ``ParallelismConfig(tp_size=...)`` for CPU processes, within
    the ``with`` block only.

    Trainer hands accelerate ``ParallelismConfig(tp_size=model.tp_size, dp_shard_size=...)``
    for a model sharded at load time (transformers 5.24 ``trainer.py`` lines 777-790);
    ``ParallelismConfig._validate_accelerator`` (accelerate ``parallelism_config.py``) then
    refuses a ``MULTI_CPU`` run, stock model or patched ("only compatible DistributedType.FSDP
    (version 2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED"), while it
    accepts ``MULTI_GPU``. This swallows that one refusal (its other checks, such as the sizes
    adding up to the world, still raise) so the CPU CI runs what GPUs run."""

    def __enter__(self):
        from accelerate.parallelism_config import ParallelismConfig

        self.cls = ParallelismConfig
        self.original = original = ParallelismConfig.__dict__["_validate_accelerator"]

        def validate(config, accelerator):
            try:
                return original(config, accelerator)
            except ValueError as exc:
                if (accelerator.distributed_type.name != "MULTI_CPU"
                        or "is only compatible" not in str(exc)):
                    raise

        self.cls._validate_accelerator = validate
        return self

    def __exit__(self, *exc):
        self.cls._validate_accelerator = self.original


def run_trainer(rank, world, mode, path, out_dir):
    """One Trainer run of ``mode`` on the TP model; rank 0 saves the record and the spy's."""
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    from fused_ce_patch import apply_fused_ce, is_fused_ce_applied

    AcceleratorState._reset_state(True)
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    if mode == "trainer_fused_pre":
        apply_fused_ce(model, backend="torch")
    args = trainer_arguments(os.path.join(out_dir, mode), fused=mode == "trainer_fused")
    spy, env = VocabParallelSpy(), dict(os.environ)  # accelerate exports ACCELERATE_* for good
    try:
        if mode == "trainer_unlifted":
            train(model, args)
        with _ParallelismOnCPU():
            trainer, record = train(model, args)
    finally:
        spy.close()
        os.environ.clear()
        os.environ.update(env)
    record.update(spy=spy.calls, spy_items=spy.items, applied=is_fused_ce_applied(model),
                  tp_size=trainer.get_tp_size(),
                  distributed_type=trainer.accelerator.distributed_type.name,
                  num_processes=trainer.accelerator.num_processes)
    if rank == 0:
        torch.save(record, os.path.join(out_dir, f"{mode}.pt"))


def run_mode(rank, world, mode, path, out_dir):
    from transformers import AutoModelForCausalLM

    from fused_ce_patch import apply_fused_ce

    if mode.startswith("trainer_"):
        return run_trainer(rank, world, mode, path, out_dir)

    if mode.startswith("fsdp"):
        from transformers.distributed.configuration_utils import DistributedConfig

        config = DistributedConfig(tp_size=2, fsdp_size=world // 2)
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config,
                                                     dtype=torch.float32)
    else:
        if "tied" in mode:  # lm_head shares the (vocabulary-sharded) embedding weight
            path = path + "_tied"
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    model.train()
    head = model.lm_head
    if "tied" in mode:
        assert head.weight is model.model.embed_tokens.weight
    layout = (type(head.weight).__name__, str(tuple(getattr(head.weight, "placements", ()))),
              tuple(head.weight.to_local().shape) if hasattr(head.weight, "to_local") else None)
    budget = SMALL_BUDGET if mode == "fused_budget" else None
    if "fused" in mode:
        apply_fused_ce(model, backend="torch", logits_budget=budget)
    spy = VocabParallelSpy()
    watcher = vp_workers.AllocationWatcher() if mode in ("stock", "fused_budget") else None
    try:
        steps = 2 if mode == "fused_twice" else 1
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            if watcher is not None:
                watcher.__enter__()
            try:
                kwargs = call_kwargs(mode)
                if mode.startswith("fsdp"):  # ranks (2i, 2i + 1) form TP group i: half i
                    half = BATCH // (world // 2)
                    rows = slice(rank // 2 * half, (rank // 2 + 1) * half)
                    kwargs = {k: v[rows] for k, v in kwargs.items()}
                out = model(**kwargs)
                out.loss.backward()
            finally:
                if watcher is not None:
                    watcher.__exit__(None, None, None)
    finally:
        spy.close()
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, out.loss.detach())
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        grads[name] = g.detach().clone()
    if rank == 0:
        result = {"loss": torch.stack(losses).mean(), "losses": losses, "grads": grads,
                  "spy": spy.calls, "layout": layout, "steps": steps,
                  "forward_after": "forward" in head.__dict__}
        if watcher is not None:
            result.update(largest=watcher.largest, peak=watcher.peak)
        torch.save(result, os.path.join(out_dir, f"{mode}.pt"))


def worker(rank, world, init_file, modes, path, out_dir):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for mode in modes:
            try:
                run_mode(rank, world, mode, path, out_dir)
            except Exception as exc:  # recorded for the test; the other modes go on
                if rank == 0:
                    with open(os.path.join(out_dir, f"{mode}.err"), "w") as f:
                        f.write("".join(traceback.format_exception(exc)))
            dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()

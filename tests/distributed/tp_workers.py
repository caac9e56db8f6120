"""Worker side of test_tensor_parallel.py: each spawned rank loads the same tiny Llama with
transformers' own tensor parallelism (``from_pretrained(path, tp_plan="auto")``: lm_head a
``colwise_gather_output`` layer, its weight a ``DTensor`` split along the vocabulary), patched
or not, runs one training forward/backward on the whole batch (tensor-parallel ranks see the
same batch) and rank 0 saves the loss, every gradient gathered to a full tensor, and what the
spy on the vocabulary-parallel loss saw. CPU and gloo."""

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
    """Records the local weight shard shape and budget of every vocabulary-parallel call."""

    def __init__(self):
        from fused_ce_patch.hf import head

        self.module, self.calls = head, []
        original = head.vocab_parallel_linear_cross_entropy

        def spy(hidden, weight_shard, labels, **kwargs):
            self.calls.append((tuple(weight_shard.shape), kwargs["vocab_start"],
                               kwargs.get("logits_budget")))
            return original(hidden, weight_shard, labels, **kwargs)

        self.original = original
        head.vocab_parallel_linear_cross_entropy = spy

    def close(self):
        self.module.vocab_parallel_linear_cross_entropy = self.original


def run_mode(rank, world, mode, path, out_dir):
    from transformers import AutoModelForCausalLM

    from fused_ce_patch import apply_fused_ce

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

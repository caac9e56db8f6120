"""Worker side of test_context_parallel.py: context parallelism (CP) on CPU processes (gloo).

Each rank loads the same tiny Llama with a test-only attention, ``all_gather_kv_attention``
(registered with transformers' ``AttentionInterface``): the rank holds a sequence shard of
q/k/v, all-gathers k and v over the CP group with an autograd-aware gather (backward returns
every rank its keys' and values' gradients) and masks causally by the *global* positions of
queries and keys. It stands in for torch's ring attention (``context_parallel``), which only
runs CUDA SDPA kernels; the rest of the step is what HF Trainer does under accelerate's
``ParallelismConfig(cp_size)``: inputs prepared and sharded as
``Trainer._prepare_context_parallel_inputs``, ``num_items_in_batch`` counted before sharding as
``Trainer._get_num_items_in_batch``, the loss scaled as ``Trainer.compute_loss`` and gradients
averaged over the CP ranks as DDP / FSDP do. Rank 0 saves per case the per-rank losses, the
reported loss, the averaged gradients and how often the fused kernel and the attention ran on
each rank. With ``tp_size=2`` on 4 processes: CP x TP, transformers' ``tp_plan="auto"`` and
FSDP2 over the CP dimension (``DistributedConfig(tp_size=2, fsdp_size=2)``, mesh (cp, tp)).
"""

from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vp_workers import leave

BATCH, SEQ = 2, 16
#: CP ranks: the processes of the CP-only run, the CP dimension of the CP x TP run.
CP_SIZE = 2
#: The name the harness's attention is registered under (test processes only).
ATTENTION = "fused_ce_test_cp_all_gather_kv"
LAYOUTS = ("contiguous", "zigzag")
#: dense: every label counts; ignored: scattered -100; shard_ignored: every shifted label of
#: rank 1's shard is -100 (that rank counts nothing).
LABELS = ("dense", "ignored", "shard_ignored")
CASES = tuple(
    {"name": f"{model}_{layout}_{labels}_{'items' if items else 'mean'}", "model": model,
     "layout": layout, "labels": labels, "items": items}
    for model in ("stock", "fused") for layout in LAYOUTS for labels in LABELS
    for items in (True, False)
)
#: CP x TP on 4 processes (a (cp, tp) = (2, 2) mesh): the zigzag layout only.
TP_SIZE = 2
TP_CASES = tuple(dict(c, name=f"tp_{c['name']}") for c in CASES
                 if c["layout"] == "zigzag" and c["labels"] != "dense")

#: The CP process group the attention gathers over (set by the worker).
_GROUP = None
#: Calls of the harness attention in this process (one per layer and forward).
ATTENTION_CALLS = [0]


def shard_positions(layout: str, rank: int, world: int, seq: int = SEQ) -> torch.Tensor:
    """Global sequence positions held by ``rank`` of ``world`` CP ranks, in shard order.

    ``contiguous``: the ``rank``-th of ``world`` equal blocks. ``zigzag`` (torch's
    load-balanced layout for causal attention): the sequence cut into ``2 * world`` chunks,
    rank r holding chunks r and ``2 * world - 1 - r``.
    """
    if layout == "contiguous":
        if seq % world:
            raise ValueError(f"seq {seq} is not divisible by world {world}")
        size = seq // world
        return torch.arange(rank * size, (rank + 1) * size)
    if layout == "zigzag":
        if seq % (2 * world):
            raise ValueError(f"seq {seq} is not divisible by 2 * world {2 * world}")
        size = seq // (2 * world)
        tail = 2 * world - 1 - rank
        return torch.cat([torch.arange(rank * size, (rank + 1) * size),
                          torch.arange(tail * size, (tail + 1) * size)])
    raise ValueError(f"layout must be 'contiguous' or 'zigzag', not {layout!r}")


class _SequenceAllGather(torch.autograd.Function):
    """All-gather of equal sequence shards along dim 2 over ``group``; the backward sums the
    ranks' gradients of the whole sequence and returns each rank its own shard's.

    Written out because ``torch.distributed.nn.functional.all_gather`` (torch 2.13) fails in
    backward on a gloo subgroup (its all-to-all passes a group rank as a global ``src``)."""

    @staticmethod
    def forward(ctx, shard, group):
        ctx.group = group
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size = dist.get_world_size(ctx.group)
        return grad.chunk(size, dim=2)[dist.get_rank(ctx.group)], None


def all_gather_kv_attention(module, query, key, value, attention_mask, dropout=0.0,
                            scaling=None, position_ids=None, **kwargs):
    """Exact causal attention of a query shard against the whole sequence's keys and values.

    Called as transformers' attention functions are: ``query`` ``[B, Hq, s, D]``, ``key`` and
    ``value`` ``[B, Hkv, s, D]`` (this rank's shard of ``s`` positions), ``position_ids``
    ``[B, s]`` or ``[1, s]`` the shard's global positions; returns ``([B, s, Hq, D], None)``.
    ``attention_mask`` (built for the local shard only) is ignored: the causal mask comes from
    the global positions (key position <= query position), so any shard layout is exact.
    """
    if position_ids is None:
        raise ValueError("all_gather_kv_attention needs position_ids (the global positions)")
    group = _GROUP
    ATTENTION_CALLS[0] += 1
    # Autograd-aware: the backward sends each rank the gradients of its own keys and values.
    keys = _SequenceAllGather.apply(key, group)
    values = _SequenceAllGather.apply(value, group)
    q_pos = position_ids.expand(query.shape[0], -1).contiguous()
    gathered = [torch.empty_like(q_pos) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, q_pos, group=group)
    k_pos = torch.cat(gathered, dim=1)
    if not torch.equal(k_pos.sort(dim=1).values,
                       torch.arange(k_pos.shape[1]).expand_as(k_pos)):
        raise ValueError("the CP shards do not tile the sequence")
    n_rep = query.shape[1] // keys.shape[1]  # grouped-query attention: share each kv head
    keys = keys.repeat_interleave(n_rep, dim=1)
    values = values.repeat_interleave(n_rep, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, keys.transpose(2, 3)) * scale
    visible = k_pos[:, None, None, :] <= q_pos[:, None, :, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, values)
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs):
    """The mask function for ``ATTENTION``: none (the attention masks by global positions)."""
    return None


def register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, all_gather_kv_attention)
    AttentionMaskInterface.register(ATTENTION, no_mask)


def batch(labels_kind: str, layout: str):
    """The whole (unsharded) batch: input ids and labels, the same in every process."""
    g = torch.Generator().manual_seed(3)
    import dist_workers

    ids = torch.randint(0, dist_workers.VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    if labels_kind == "ignored":
        labels[0, [2, 5, 11]] = -100
        labels[1, :4] = -100
    elif labels_kind == "shard_ignored":  # shift_labels[p] = labels[p + 1]: none counts on rank 1
        p = shard_positions(layout, 1, CP_SIZE) + 1
        labels[:, p[p < SEQ]] = -100
    elif labels_kind != "dense":
        raise ValueError(labels_kind)
    return ids, labels


def trainer_inputs(ids, labels):
    """What ``Trainer._prepare_context_parallel_inputs`` (transformers 5.24, trainer.py
    2401-2490, torch CP backend) adds before sharding: ``shift_labels`` (labels padded with
    -100 on the right, shifted left) and ``position_ids`` (arange over the sequence)."""
    shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    position_ids = torch.arange(ids.size(1)).expand(ids.size(0), -1)
    return {"input_ids": ids, "labels": labels, "shift_labels": shift_labels,
            "position_ids": position_ids}


def num_items_in_batch(labels, tp_size: int, cp_size: int):
    """``Trainer._get_num_items_in_batch`` (trainer.py 2306-2367) for a causal LM whose
    collator gives no ``shift_labels``: counted over ``labels[..., 1:]`` *before* the CP
    sharding (``get_batch_samples`` runs before ``training_step`` prepares the CP inputs);
    with ``average_tokens_across_devices`` (default True) summed over every process
    (``accelerator.gather(...).sum()``), then divided by ``tp_size * cp_size * sp_size``
    because the ranks of one CP (and TP) group all counted the same batch. A float tensor, as
    there."""
    count = labels[..., 1:].ne(-100).sum()
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    sp_size = 1
    return torch.stack(counts).sum() / (tp_size * cp_size * sp_size)


def run_case(rank, world, tp_size, case, models, out_dir):
    import dist_workers
    import tp_workers

    model = models[case["model"]]
    model.zero_grad(set_to_none=True)
    cp_size = world // tp_size
    ids, labels = batch(case["labels"], case["layout"])
    inputs = trainer_inputs(ids, labels)
    n_items = num_items_in_batch(labels, tp_size, cp_size) if case["items"] else None
    # The (cp, tp) mesh is row-major: the TP ranks of one CP rank hold the same shard.
    positions = shard_positions(case["layout"], rank // tp_size, cp_size)
    local = {k: v.index_select(1, positions) for k, v in inputs.items()}
    if n_items is not None:
        local["num_items_in_batch"] = n_items
    # The fused kernel: the torch backend on one device, the vocabulary-parallel loss under TP.
    spy = dist_workers.BackendSpy() if tp_size == 1 else tp_workers.VocabParallelSpy()
    attention_calls = ATTENTION_CALLS[0]
    try:
        out = model(**local)
    finally:
        spy.close()
    attention_calls = ATTENTION_CALLS[0] - attention_calls
    loss = out.loss
    # Trainer.compute_loss (trainer.py 2208-2215): with average_tokens_across_devices and
    # num_items_in_batch the loss is scaled by num_processes // tp_size, undoing the
    # gradient averaging below; without num_items_in_batch it is left as the model gives it.
    scaled = loss * (world // tp_size) if n_items is not None else loss
    scaled.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):  # FSDP2 on the cp dimension has averaged it already
            grads[name] = g.full_tensor().detach().clone()
            continue
        g = g.detach().clone()
        dist.all_reduce(g)
        grads[name] = g / world  # as DDP / FSDP average the CP (and DP) ranks' gradients
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    scaled_all = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(scaled_all, scaled.detach())
    calls = [None] * world
    fused_calls = len(spy.shapes if tp_size == 1 else spy.calls)
    dist.all_gather_object(calls, (fused_calls, attention_calls))
    losses = torch.stack(losses)
    if not torch.allclose(losses, losses[::tp_size].repeat_interleave(tp_size), rtol=0, atol=0,
                          equal_nan=True):
        raise AssertionError(f"the TP ranks of one CP rank disagree: {losses}")
    if rank == 0:
        torch.save({"losses": losses[::tp_size],  # one per CP rank
                    # what Trainer logs: the mean over processes of each one's step loss
                    # (nested_gather(tr_loss).mean(), trainer.py 2257)
                    "reported": torch.stack(scaled_all).mean(),
                    "grads": grads, "calls": calls, "num_items": n_items,
                    "attention": model.config._attn_implementation,
                    "layers": model.config.num_hidden_layers},
                   os.path.join(out_dir, f"{case['name']}.pt"))


def load_models(path, tp_size, cp_size):
    """The stock and the patched model. With ``tp_size > 1``: transformers' TP
    (``tp_plan="auto"``) and FSDP2 over the other mesh dimension, which is the CP dimension, as
    accelerate shards FSDP over its flattened ``dp_shard x cp`` dimension."""
    from transformers import AutoModelForCausalLM

    from fused_ce_patch import apply_fused_ce

    extra = {}
    if tp_size > 1:
        from transformers.distributed.configuration_utils import DistributedConfig

        extra["distributed_config"] = DistributedConfig(tp_size=tp_size, fsdp_size=cp_size)
    models = {}
    for kind in ("stock", "fused"):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTENTION,
                                                     dtype=torch.float32, **extra)
        model.train()
        if kind == "fused":
            apply_fused_ce(model, backend="torch")
        models[kind] = model
    return models


def worker(rank, world, init_file, cases, path, out_dir, tp_size=1):
    global _GROUP
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        cp_size = world // tp_size
        if tp_size == 1:
            _GROUP = dist.group.WORLD
        else:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (cp_size, tp_size), mesh_dim_names=("cp", "tp"))
            _GROUP = mesh["cp"].get_group()
        register()
        models = load_models(path, tp_size, cp_size)
        for case in cases:
            try:
                run_case(rank, world, tp_size, case, models, out_dir)
            except Exception as exc:  # recorded for the test; the other cases go on
                with open(os.path.join(out_dir, f"{case['name']}.{rank}.err"), "w") as f:
                    f.write("".join(traceback.format_exception(exc)))
            dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()

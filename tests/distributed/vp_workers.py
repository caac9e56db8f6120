"""Worker side of test_vocab_parallel.py: each spawned rank builds the same random problem
(seeded), keeps its slice of the vocabulary, runs ``vocab_parallel_linear_cross_entropy`` and
its backward, and saves what it got (loss, dH, its dW / db shard, its shard bounds) for the
test process to compare with a single-process float64 reference. CPU and gloo only."""

from __future__ import annotations

import datetime
import os
import sys
import traceback
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def problem(case: dict):
    """The whole (unsharded) problem of ``case``, identical in every process."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    dtype = getattr(torch, case.get("dtype", "float64"))
    n, v, h = case["n"], case["v"], case["h"]
    hidden = torch.randn(*case.get("lead", (n,)), h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * case.get("wscale", 1.0)
    bias = torch.randn(v, generator=g, dtype=torch.float64) if case.get("bias") else None
    labels = torch.randint(0, v, hidden.shape[:-1], generator=g)
    ignored = case.get("ignored", 0.0)
    if ignored:
        labels[torch.rand(labels.shape, generator=g) < ignored] = -100
    if "ignore_index" in case:  # some labels carry the custom ignore value
        labels.view(-1)[::4] = case["ignore_index"]
    if case.get("nan"):  # one NaN hidden entry: the loss must say so on every rank
        hidden.view(-1, h)[3, 0] = float("nan")
    upstream = torch.rand(labels.shape, generator=g, dtype=torch.float64) + 0.5
    cast = (lambda t: None if t is None else t.to(dtype))
    return cast(hidden), cast(weight), cast(bias), labels, upstream


def bounds(case: dict, rank: int, world: int):
    """``[start, stop)`` of this rank's shard: ``splits`` if given, else torch.chunk's split."""
    v = case["v"]
    if "splits" in case:
        sizes = case["splits"]
    else:
        per = -(-v // world)
        sizes = [max(0, min(per, v - r * per)) for r in range(world)]
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def options(case: dict) -> dict:
    keys = ("ignore_index", "reduction", "num_items_in_batch", "shift", "softcap", "logit_scale",
            "label_smoothing", "z_loss", "logits_budget")
    out = {k: case[k] for k in keys if k in case}
    if isinstance(out.get("num_items_in_batch"), float):  # a tensor, as Trainer passes it
        out["num_items_in_batch"] = torch.tensor(out["num_items_in_batch"])
    return out


class AllocationWatcher(TorchDispatchMode):
    """Records the largest tensor any op creates (elements) and the peak bytes of the tensors
    created under it that are alive at once (storages counted once, freed when their last
    tensor dies). A ``DTensor`` output counts as its local tensor."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.live = {}  # storage data_ptr -> [bytes, ids of live tensors]
        self.now = 0
        self.peak = 0

    def _gone(self, key, ident):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1].discard(ident)
        if not entry[1]:
            self.now -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            t = getattr(t, "_local_tensor", t)  # a DTensor: what this rank holds
            self.largest = max(self.largest, t.numel())
            try:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
            except RuntimeError:  # a storage without data (e.g. an in-flight collective's)
                key, nbytes = ("tensor", id(t)), t.numel() * t.element_size()
            entry = self.live.get(key)
            if entry is None:
                entry = self.live[key] = [nbytes, set()]
                self.now += entry[0]
                self.peak = max(self.peak, self.now)
            if id(t) not in entry[1]:
                entry[1].add(id(t))
                weakref.finalize(t, self._gone, key, id(t))
        return out


def rank_labels(case, rank, labels):
    """This rank's labels: the shared ones, or for the refusal cases a corrupted copy."""
    if case.get("corrupt_rank") == rank:  # this rank's labels differ from the others'
        labels = labels.clone()
        labels.view(-1)[0] = (labels.view(-1)[0] + 1) % case["v"]
    if case.get("collide_rank") == rank:  # an out-of-range label, same fingerprint checksum
        labels = labels.clone()
        flat, shift = labels.view(-1), case["v"] + 2 - int(labels.view(-1)[0])
        flat[0] += shift  # positions 0 and 997 weigh alike in the checksum
        flat[997] -= shift
    return labels


def run_case(rank, world, case, out_dir):
    from fused_ce_patch.vocab_parallel import vocab_parallel_linear_cross_entropy

    hidden, weight, bias, labels, upstream = problem(case)
    start, stop = bounds(case, rank, world)
    labels = rank_labels(case, rank, labels)
    hidden = hidden.clone().requires_grad_(True)
    w = weight[start:stop].clone().requires_grad_(True)
    b = None if bias is None else bias[start:stop].clone().requires_grad_(True)
    opts = options(case)
    scale = None
    if case.get("scale_tensor"):  # a learnable logit scale: a 0-d tensor that requires grad
        scale = opts["logit_scale"] = torch.tensor(case["logit_scale"], dtype=hidden.dtype,
                                                   requires_grad=True)
    watcher = AllocationWatcher() if case.get("watch") else None
    if watcher is not None:
        watcher.__enter__()
    try:
        loss = vocab_parallel_linear_cross_entropy(
            hidden, w, labels, vocab_start=start, vocab_size=case["v"], bias_shard=b, **opts,
        )
        if loss.dim():
            loss.backward(upstream.to(loss.dtype))
        else:
            loss.backward()
    finally:
        if watcher is not None:
            watcher.__exit__(None, None, None)
    result = {"loss": loss.detach(), "dh": hidden.grad, "dw": w.grad,
              "db": None if b is None else b.grad, "start": start, "stop": stop,
              "ds": None if scale is None else scale.grad}
    if watcher is not None:
        result.update(largest=watcher.largest, peak=watcher.peak)
    torch.save(result, os.path.join(out_dir, f"{case['name']}.{rank}.pt"))


STATS_FIELDS = ("log_probs", "entropy", "is_top1", "mask", "mean_logits", "log_sum_sq_probs")


def stats_problem(case: dict):
    """``problem(case)`` plus a second upstream gradient (for the entropy); with ``tie``
    (increasing columns), those weight rows zero and their biases 6, so that most rows'
    maximum is attained exactly at every one of them, and labels naming each of them."""
    hidden, weight, bias, labels, up_lp = problem(case)
    g = torch.Generator().manual_seed(case.get("seed", 0) + 1)
    up_ent = torch.randn(labels.shape, generator=g, dtype=torch.float64)
    tie = case.get("tie", ())
    for i, col in enumerate(tie):
        weight[col] = 0.0
        bias[col] = 6.0
        labels.view(-1)[i::len(tie) + 1] = col
    return hidden, weight, bias, labels, up_lp, up_ent


def stats_options(case: dict) -> dict:
    keys = ("ignore_index", "shift", "softcap", "logit_scale", "temperature", "entropy",
            "accuracy", "mean_logits", "log_sum_sq_probs", "logits_budget")
    return {k: case[k] for k in keys if k in case}


def run_stats_case(rank, world, case, out_dir):
    from fused_ce_patch.vocab_parallel_stats import vocab_parallel_linear_token_stats

    hidden, weight, bias, labels, up_lp, up_ent = stats_problem(case)
    start, stop = bounds(case, rank, world)
    labels = rank_labels(case, rank, labels)
    hidden = hidden.clone().requires_grad_(True)
    w = weight[start:stop].clone().requires_grad_(True)
    b = None if bias is None else bias[start:stop].clone().requires_grad_(True)
    out = vocab_parallel_linear_token_stats(
        hidden, w, labels, vocab_start=start, vocab_size=case["v"], bias_shard=b,
        **stats_options(case),
    )
    loss = 0.0
    if case.get("grad_lp", True):
        loss = loss + (out.log_probs * up_lp.to(out.log_probs.dtype)).sum()
    if case.get("grad_entropy"):
        loss = loss + (out.entropy * up_ent.to(out.entropy.dtype)).sum()
    loss.backward()
    result = {f: getattr(out, f) for f in STATS_FIELDS}
    result = {k: None if v is None else v.detach() for k, v in result.items()}
    result.update(dh=hidden.grad, dw=w.grad, db=None if b is None else b.grad, start=start,
                  stop=stop)
    torch.save(result, os.path.join(out_dir, f"{case['name']}.{rank}.pt"))


def leave():
    """End a worker whose results are all on disk without tearing the process group down.

    Seen here in 2 of 9 runs on a loaded 2-core machine: gloo's background threads
    abort the process (``terminate called without an active exception``, SIGABRT) while it is
    torn down after its peers have left, which fails ``mp.spawn`` although every result was
    written. The last barrier has passed on every rank, so nothing is in flight."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker(rank, world, init_file, cases, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        for case in cases:
            try:
                (run_stats_case if case.get("stats") else run_case)(rank, world, case, out_dir)
            except Exception as exc:  # recorded for the test; every rank raises alike
                with open(os.path.join(out_dir, f"{case['name']}.{rank}.err"), "w") as f:
                    f.write("".join(traceback.format_exception(exc)))
            dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()

"""transformers' tensor parallelism on 2 CPU processes (gloo): a tiny Llama loaded with
``from_pretrained(path, tp_plan="auto")`` (lm_head ``colwise_gather_output``, weight a
``DTensor`` split along the vocabulary) is patched, its lm_head recognised, and one training
step computes the loss vocabulary-parallel from each rank's shard (spy): loss and every
gradient equal the stock tensor-parallel model's and one process running the stock model on
the whole batch, also with ignored labels and ``num_items_in_batch`` and over two steps, and
with lm_head tied to the embedding, and under transformers' FSDP2 x TP (4 processes); a
dispatch watcher shows the patched step never creates a ``[tokens, vocab / tp]`` tensor under a
small budget while the stock step creates ``[tokens, vocab]``. Layouts the fused loss cannot
compute raise. Single-process checks of the layout recognition run in a world of one.

The same TP model also trains through transformers' Trainer (4 SGD steps, gradient
accumulation 2, ignored labels; one micro-batch and, last, a whole step count none): patched
by the flag or by ``apply_fused_ce`` before ``Trainer(...)``, its per-step losses (NaN for the
step that counts nothing, as stock), the gradients of each step and the parameters it ends
with equal the stock TP Trainer's and one process running the stock Trainer on the same
micro-batches; the spy shows the vocabulary-parallel loss ran on every micro-batch with
Trainer's ``num_items_in_batch``. On CPU this needs one accelerate check lifted: Trainer hands
accelerate ``ParallelismConfig(tp_size=2)`` for a TP model, and accelerate 1.15 refuses that
for CPU processes (``MULTI_CPU``), the stock model exactly as the patched one, while it
accepts it on GPUs (``MULTI_GPU``). The spawned workers alone swallow that one ``ValueError``
while their Trainer is built and trains (``tp_workers._ParallelismOnCPU``; accelerate's other
checks still run, and ``trainer_unlifted`` shows the refusal is still there); the test
process is never changed."""

from __future__ import annotations

import math
import os

import pytest
import torch

import dist_workers as dw
import tp_workers as w

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

WORLD = 2
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("tp")
    path = out / "model"
    dw.build(tied=False).save_pretrained(path)
    dw.build(tied=True).save_pretrained(f"{path}_tied")
    mp.spawn(w.worker, args=(WORLD, str(out / "init"), (*w.MODES, *w.TRAINER_MODES), str(path),
                              str(out)), nprocs=WORLD)
    return out


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("tp_fsdp")
    path = out / "model"
    dw.build(tied=False).save_pretrained(path)
    mp.spawn(w.worker, args=(4, str(out / "init"), w.FSDP_MODES, str(path), str(out)),
             nprocs=4)
    return out


def load(results, mode):
    err = results / f"{mode}.err"
    assert not err.exists(), err.read_text()
    return torch.load(results / f"{mode}.pt")


def single_process(mode):
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = dw.build(tied="tied" in mode)
    model.loss_function = ForCausalLMLoss
    out = model(**w.call_kwargs(mode))
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def compare(got, loss, grads):
    assert rel(got["loss"], loss) <= LOSS_RTOL, (got["loss"], loss)
    assert set(got["grads"]) == set(grads)
    for name, g in grads.items():
        assert rel(got["grads"][name], g) <= GRAD_RTOL, (name, rel(got["grads"][name], g))


@pytest.mark.parametrize("mode", ["fused", "fused_items", "fused_budget", "fused_twice",
                                  "fused_tied"])
def test_patched_tp_model_matches_stock_tp_and_one_process(results, mode):
    got = load(results, mode)
    assert got["layout"] == ("DTensor", "(Shard(dim=0),)", (106, dw.HIDDEN)), got["layout"]
    budget = w.SMALL_BUDGET if mode == "fused_budget" else None
    assert got["spy"] == [((106, dw.HIDDEN), 0, budget)] * got["steps"], got["spy"]
    assert torch.equal(got["losses"][0], got["losses"][1]), "the loss differs between ranks"
    assert got["forward_after"], "transformers' tensor-parallel forward stays installed"
    if "tied" not in mode:  # the tied model is compared with one process only
        stock = load(results, "stock_items" if "items" in mode else "stock")
        assert stock["spy"] == []
        compare(got, stock["loss"], stock["grads"])
    compare(got, *single_process(mode))


def test_stock_tp_model_matches_one_process(results):
    # the comparison above is only as good as stock TP's own agreement with one process
    for mode in ("stock", "stock_items"):
        compare(load(results, mode), *single_process(mode))


def test_patched_tp_x_fsdp2_matches_stock_and_one_process(results4):
    """transformers' FSDP2 x TP on 4 processes: lm_head is an FSDP unit whose weight is a
    (fsdp, tp) DTensor; inside its call FSDP2 gathers the fsdp dimension and the loss runs
    vocabulary-parallel over the tp dimension (the spy sees the tp shard)."""
    got = load(results4, "fsdp_fused")
    assert "_StridedShard" in got["layout"][1], got["layout"]  # (fsdp, tp) as loaded
    assert got["spy"] == [((106, dw.HIDDEN), 0, None)], got["spy"]
    stock = load(results4, "fsdp_stock")
    assert stock["spy"] == []
    compare(got, stock["loss"], stock["grads"])
    compare(got, *single_process("fused"))


def test_no_tokens_by_vocab_tensor_under_a_small_budget(results):
    tokens = w.BATCH * w.SEQ
    fused, stock = load(results, "fused_budget"), load(results, "stock")
    assert stock["largest"] >= tokens * dw.VOCAB, "the watcher sees stock's gathered logits"
    assert fused["largest"] < tokens * 106, fused["largest"]  # rank 0's shard has 106 rows
    assert fused["peak"] < stock["peak"], (fused["peak"], stock["peak"])


# -- Trainer on the TP model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process_trainer(tmp_path_factory):
    """The stock model (same weights as the saved one) trained by the stock Trainer in this
    process on the same rows, with the same arguments; also the parameters it started from."""
    from accelerate.state import AcceleratorState
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = dw.build(tied=False)
    model.loss_function = ForCausalLMLoss  # transformers' own loss, whatever LOSS_MAPPING holds
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    env = dict(os.environ)  # accelerate and its imports export variables for good
    AcceleratorState._reset_state(True)
    try:
        _, record = w.train(model, w.trainer_arguments(str(tmp_path_factory.mktemp("one")),
                                                       fused=False))
    finally:
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(env)
    record["before"] = before
    return record


def step_items():
    """Counted (shifted) labels of each optimizer step, once per micro-batch of the step."""
    rows = w.trainer_rows()
    per_step = w.TRAINER_ACCUM * w.TRAINER_MICRO
    out = []
    for step in range(w.TRAINER_STEPS):
        labels = torch.stack([r["labels"] for r in rows[step * per_step:(step + 1) * per_step]])
        out += [float((labels[:, 1:] != -100).sum())] * w.TRAINER_ACCUM
    return out


def same_number(a, b, rtol):
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rtol * abs(b)


def compare_trainer_runs(got, want, before):
    """Per-step logged losses (NaN where stock's is) and the gradients each optimizer step
    applied (relative 1e-5; zero where stock's are), and the parameters training ends with:
    their update ``after - before`` within 1e-5 of its norm plus one float32 rounding of the
    parameters per step (SGD at this learning rate moves the norm weights by ~4e-4 of their
    norm, so a plain 1e-5 of the parameters would let a 2 % error of their gradients through,
    and 1e-5 of the update is below float32's rounding)."""
    assert len(got["losses"]) == len(want["losses"]) == w.TRAINER_STEPS
    for a, b in zip(got["losses"], want["losses"]):
        assert same_number(a, b, LOSS_RTOL), (got["losses"], want["losses"])
    assert same_number(got["training_loss"], want["training_loss"], LOSS_RTOL)
    assert len(got["grads"]) == len(want["grads"]) == w.TRAINER_STEPS
    for step, (g, r) in enumerate(zip(got["grads"], want["grads"])):
        assert set(g) == set(r) == set(before)
        for name in r:
            if not r[name].any():
                assert not g[name].any(), (step, name)
                continue
            assert rel(g[name], r[name]) <= GRAD_RTOL, (step, name, rel(g[name], r[name]))
    assert set(got["params"]) == set(want["params"]) == set(before)
    eps = torch.finfo(torch.float32).eps
    for name, p in want["params"].items():
        update = p - before[name]
        assert update.norm() > 0, f"{name} was not trained"
        error = (got["params"][name] - p).double().norm()
        bound = GRAD_RTOL * update.double().norm() + w.TRAINER_STEPS * eps * p.double().norm()
        assert error <= bound, (name, error, bound)


def test_one_process_trainer_counts_the_step(one_process_trainer):
    # the reference the TP runs are held to: every row once, in order, each micro-batch given
    # the counted labels of its whole optimizer step; the last step counts none: stock logs
    # NaN (0 / 0) and applies zero gradients
    rows = w.trainer_rows()
    batches = one_process_trainer["batches"]
    assert torch.equal(torch.cat(batches), torch.stack([r["input_ids"] for r in rows]))
    assert one_process_trainer["items"] == step_items()
    assert step_items()[-1] == 0.0 and math.isnan(one_process_trainer["losses"][-1])
    assert not any(g.any() for g in one_process_trainer["grads"][-1].values())
    assert all(math.isfinite(x) for x in one_process_trainer["losses"][:-1])


def test_stock_tp_trainer_matches_one_process(results, one_process_trainer):
    """Trainer's TP bookkeeping, transformers 5.24 ``trainer.py``: both ranks get every
    micro-batch (accelerate ``data_loader.py`` ``prepare_data_loader``: ``process_index //
    tp_size``, data-parallel size 1); ``_get_num_items_in_batch`` (lines 2347-2365) gathers the
    count of both ranks and divides by ``get_tp_size()`` = 2 (``model._tp_size``, lines
    2599-2605), giving the one-process count; ``compute_loss`` (lines 2208-2215) multiplies the
    loss by ``num_processes // tp_size`` = 1; the logged loss is the mean over ranks of
    identical values (line 2257). So the TP run sees the one-process micro-batches and
    divisors, step for step."""
    got = load(results, "trainer_stock")
    assert (got["distributed_type"], got["num_processes"], got["tp_size"]) == ("MULTI_CPU", 2, 2)
    assert got["spy"] == [] and not got["applied"]
    assert all(torch.equal(a, b) for a, b in zip(got["batches"], one_process_trainer["batches"]))
    assert got["items"] == one_process_trainer["items"]
    compare_trainer_runs(got, one_process_trainer, one_process_trainer["before"])


@pytest.mark.parametrize("mode", ["trainer_fused", "trainer_fused_pre"])
def test_patched_tp_trainer_matches_stock_tp_and_one_process(results, one_process_trainer, mode):
    got = load(results, mode)
    assert got["applied"]
    # the vocabulary-parallel loss ran on every micro-batch, on rank 0's shard, with the
    # step's count that Trainer computed
    calls = w.TRAINER_STEPS * w.TRAINER_ACCUM
    assert got["spy"] == [((106, dw.HIDDEN), 0, None)] * calls, got["spy"]
    assert got["spy_items"] == got["items"] == step_items()
    assert all(torch.equal(a, b) for a, b in zip(got["batches"], one_process_trainer["batches"]))
    before = one_process_trainer["before"]
    compare_trainer_runs(got, load(results, "trainer_stock"), before)
    compare_trainer_runs(got, one_process_trainer, before)


def test_accelerate_still_refuses_tp_on_cpu_without_the_lift(results):
    # stock model, no lift: the refusal the workers lift is accelerate's, not ours
    err = results / "trainer_unlifted.err"
    assert err.exists(), "accelerate accepts ParallelismConfig on CPU now: drop the lift"
    text = err.read_text()
    assert "is only compatible" in text and "MULTI_CPU" in text, text


# -- single process: what the layout recognition accepts and refuses --------------------------



def _tp_head(style_name):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    torch.manual_seed(0)
    head = nn.Linear(8, 13, bias=True)
    mesh = init_device_mesh("cpu", (1,))
    style = ALL_PARALLEL_STYLES[style_name]
    for param in ("weight", "bias"):
        style.shard_param(head, param, mesh)
    style.install_forward(head, mesh)
    return head


@pytest.mark.parametrize("hidden_kind", ["tensor", "replicated_dtensor"])
def test_world_of_one_tp_head_equals_its_own_call(world_of_one, hidden_kind):
    from torch.distributed.tensor import DTensor, Replicate

    from fused_ce_patch.hf.head import check_head, fused_head_loss

    head = _tp_head("colwise_gather_output")
    check_head(head)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    labels = torch.randint(0, 13, (2, 5))
    given = hidden
    if hidden_kind == "replicated_dtensor":  # what a module with DTensor outputs hands over
        given = DTensor.from_local(hidden, head.weight.device_mesh, [Replicate()])
    loss, vocab = fused_head_loss(head, given, labels, logit_scale=0.5, shift=True)
    loss.backward()
    got = (hidden.grad.clone(), head.weight.grad.full_tensor(), head.bias.grad.full_tensor())
    hidden.grad = head.weight.grad = head.bias.grad = None
    logits = head(hidden) * 0.5
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 13),
                                            labels[:, 1:].reshape(-1))
    ref.backward()
    assert vocab == 13
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    want = (hidden.grad, head.weight.grad.full_tensor(), head.bias.grad.full_tensor())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_other_tp_layouts_are_refused(world_of_one, style):
    from fused_ce_patch.errors import UnsupportedModelError
    from fused_ce_patch.hf.head import check_head

    head = _tp_head(style)
    with pytest.raises(UnsupportedModelError, match="tensor-parallel layer"):
        check_head(head)


def test_tp_forward_around_another_forward_is_refused(world_of_one):
    from fused_ce_patch.errors import UnsupportedModelError
    from fused_ce_patch.hf.head import check_head

    head = _tp_head("colwise_gather_output")
    tp_forward = head.forward
    head.forward = lambda x: tp_forward(x)  # a user wrapper around transformers' forward
    with pytest.raises(UnsupportedModelError, match="replaced forward"):
        check_head(head)


def test_tp_forward_installed_twice_is_refused(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    from fused_ce_patch.errors import UnsupportedModelError
    from fused_ce_patch.hf.head import check_head

    head = _tp_head("colwise_gather_output")
    mesh = init_device_mesh("cpu", (1,))
    ALL_PARALLEL_STYLES["colwise_gather_output"].install_forward(head, mesh)
    with pytest.raises(UnsupportedModelError, match="not nn.Linear.forward"):
        check_head(head)


def test_torch_parallelize_module_head_is_refused(world_of_one):
    # torch's own ColwiseParallel works through forward hooks, which the fused loss would bypass
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fused_ce_patch.errors import UnsupportedModelError
    from fused_ce_patch.hf.head import check_head

    head = parallelize_module(nn.Linear(8, 13), init_device_mesh("cpu", (1,)),
                              ColwiseParallel(output_layouts=Replicate()))
    with pytest.raises(UnsupportedModelError, match="forward hooks"):
        check_head(head)


def test_sequence_sharded_hidden_is_refused(world_of_one):
    from torch.distributed.tensor import DTensor, Shard

    from fused_ce_patch.errors import UnsupportedModelError
    from fused_ce_patch.hf.head import fused_head_loss

    head = _tp_head("colwise_gather_output")
    hidden = DTensor.from_local(torch.randn(2, 5, 8), head.weight.device_mesh, [Shard(1)])
    with pytest.raises(UnsupportedModelError, match="sequence parallelism"):
        fused_head_loss(head, hidden, torch.randint(0, 13, (2, 5)))


@pytest.mark.parametrize("adapters", ["enabled", "disabled"])
def test_lora_on_a_tp_head_is_refused_by_name(world_of_one, adapters):
    # PEFT LoRA around transformers' colwise_gather_output head: stock fails inside PEFT's
    # forward (a [.., V] LoRA delta added to the gathered logits of a shard-sized base); the
    # fused loss must refuse by name, at apply time, not fail in torch.cat on a DTensor
    pytest.importorskip("peft")
    from peft import LoraConfig, inject_adapter_in_model
    from torch import nn

    from fused_ce_patch.errors import UnsupportedModelError
    from fused_ce_patch.hf.head import check_head, fused_head_loss

    holder = nn.Module()
    holder.lm_head = _tp_head("colwise_gather_output")
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["lm_head"]), holder)
    head = holder.lm_head
    assert type(head).__name__ == "Linear" and hasattr(head, "lora_A"), type(head)
    if adapters == "disabled":
        head.enable_adapters(False)
    with pytest.raises(UnsupportedModelError, match="LoRA.*tensor-parallel"):
        check_head(head)
    with pytest.raises(UnsupportedModelError, match="LoRA.*tensor-parallel"):
        fused_head_loss(head, torch.randn(2, 5, 8), torch.randint(0, 13, (2, 5)))

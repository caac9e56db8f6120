"""transformers' tensor parallelism on 2 CPU processes (gloo): a tiny Llama loaded with
``from_pretrained(path, tp_plan="auto")`` (lm_head ``colwise_gather_output``, weight a
``DTensor`` split along the vocabulary) is patched, its lm_head recognised, and one training
step computes the loss vocabulary-parallel from each rank's shard (spy): loss and every
gradient equal the stock tensor-parallel model's and one process running the stock model on
the whole batch, also with ignored labels and ``num_items_in_batch`` and over two steps, and
with lm_head tied to the embedding, and under transformers' FSDP2 x TP (4 processes); a
dispatch watcher shows the patched step never creates a ``[tokens, vocab / tp]`` tensor under a
small budget while the stock step creates ``[tokens, vocab]``. Layouts the fused loss cannot
compute raise. Single-process checks of the layout recognition run in a world of one."""

from __future__ import annotations

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
    mp.spawn(w.worker, args=(WORLD, str(out / "init"), w.MODES, str(path), str(out)),
             nprocs=WORLD)
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

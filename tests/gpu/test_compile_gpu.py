"""torch.compile on a CUDA GPU (marker ``gpu``; skipped without CUDA).

Run: ``pytest -m gpu tests/gpu/test_compile_gpu.py -q``. A patched tiny Llama on CUDA gives
the same loss and gradients compiled (Inductor) as eager, the fused loss runs as the
``fused_ce::linear_cross_entropy_and_grads`` custom op (spy), ``mode="reduce-overhead"`` (CUDA
graphs) follows every batch's labels, a step captured by ``torch.cuda.graph`` runs the stock
loss and replays right, and the functional compiles with ``fullgraph=True`` (no graph break at
the loss).
"""

from __future__ import annotations

import pytest
import torch

from fused_ce_patch import apply_fused_ce, fused_linear_cross_entropy, ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def _fp32_matmul_exact():
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev


def _spy(monkeypatch):
    calls = []
    original = ops._eager

    def counted(*args):
        calls.append(args[0].device.type)
        return original(*args)

    monkeypatch.setattr(ops, "_eager", counted)
    return calls


def _tiny_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=4099, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, attn_implementation="sdpa",
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", dtype).train()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4099, (4, 64), generator=g)
    labels = ids.clone()
    labels[1, :10] = -100
    return ids.cuda(), labels.cuda()


# float32 (TF32 off) is the strict check; in bfloat16 Inductor's fused decoder kernels round
# differently from eager ones, so only gross errors (a wrong or missing gradient) can show.
@pytest.mark.parametrize("dtype,loss_tol,grad_tol", [(torch.float32, 1e-5, 1e-4),
                                                     (torch.bfloat16, 1e-2, 1e-1)])
def test_compiled_vs_eager_patched_llama(monkeypatch, dtype, loss_tol, grad_tol):
    ids, labels = _batch()
    eager = apply_fused_ce(_tiny_llama(dtype))
    out_e = eager(input_ids=ids, labels=labels)
    out_e.loss.backward()
    model = apply_fused_ce(_tiny_llama(dtype))
    calls = _spy(monkeypatch)
    out_c = torch.compile(model)(input_ids=ids, labels=labels)
    out_c.loss.backward()
    assert calls == ["cuda"]  # one op: it returns the gradients with the loss
    assert torch.isfinite(out_c.loss)
    rel = ((out_c.loss.double() - out_e.loss.double()).abs() / out_e.loss.double().abs()).item()
    assert rel <= loss_tol, rel
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        err = ((p.grad.double() - q.grad.double()).norm() / q.grad.double().norm()).item()
        assert err <= grad_tol, (name, err)


def test_reduce_overhead_patched_llama(monkeypatch):
    """``torch.compile(mode="reduce-overhead")``: CUDA graphs around the fused loss, whose op is
    tagged cudagraph_unsafe (it reads the labels on the host). Steps whose ignored counts differ
    each match eager at those labels: a captured op would replay the first batch's count."""
    ids, labels = _batch()
    eager = apply_fused_ce(_tiny_llama(torch.float32))
    model = apply_fused_ce(_tiny_llama(torch.float32))
    compiled = torch.compile(model, mode="reduce-overhead")
    calls = _spy(monkeypatch)
    for step, ignored in enumerate((10, 0, 40, 5)):
        y = labels.clone()
        y[1] = ids[1]
        y[1, :ignored] = -100
        want = eager(input_ids=ids, labels=y).loss
        want.backward()
        got = compiled(input_ids=ids, labels=y).loss
        got.backward()
        assert calls == ["cuda"] * (step + 1)  # the op ran eagerly at every step
        rel = ((got.double() - want.double()).abs() / want.double().abs()).item()
        assert rel <= 1e-5, (step, rel)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            err = ((p.grad.double() - q.grad.double()).norm() / q.grad.double().norm()).item()
            assert err <= 1e-4, (step, name, err)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


def test_cuda_graph_capture_of_a_patched_step():
    """A training step captured by ``torch.cuda.graph``: during the capture the patched forward
    computes its stock loss (the fused loss reads the labels on the host), and each replay with
    other labels copied in gives the stock step's loss and gradients for those labels; outside
    a capture the fused loss runs again, and the functional refuses a capture by name."""
    ids, labels = _batch()
    model = apply_fused_ce(_tiny_llama(torch.float32))
    ref = _tiny_llama(torch.float32)  # the same seed: the same weights, stock
    static_labels = labels.clone()

    def step():
        loss = model(input_ids=ids, labels=static_labels, use_cache=False).loss
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch's CUDA graph docs do
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(RuntimeWarning, match="CUDA graph is being captured"):
        with torch.cuda.graph(graph):
            static_loss = step()
    for ignored in (10, 0, 40):
        y = labels.clone()
        y[1] = ids[1]
        y[1, :ignored] = -100
        static_labels.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        ref.zero_grad(set_to_none=True)
        want = ref(input_ids=ids, labels=y, use_cache=False).loss
        want.backward()
        rel = ((static_loss.double() - want.double()).abs() / want.double().abs()).item()
        assert rel <= 1e-5, (ignored, rel)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            err = ((p.grad.double() - q.grad.double()).norm() / q.grad.double().norm()).item()
            assert err <= 1e-4, (ignored, name, err)
    from fused_ce_patch.hf.sentinel import NotMaterializedLogits

    assert isinstance(model(input_ids=ids, labels=labels).logits, NotMaterializedLogits)
    h = torch.randn(8, 128, device="cuda")
    w = torch.randn(4099, 128, device="cuda")
    with pytest.raises(RuntimeError, match="CUDA graph is being captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fused_linear_cross_entropy(h, w, labels[0, :8])


def test_functional_full_graph_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(300, 256, device="cuda", generator=g, dtype=torch.bfloat16,
                    requires_grad=True)
    w = torch.randn(5003, 256, device="cuda", generator=g, dtype=torch.bfloat16,
                    requires_grad=True)
    y = torch.randint(0, 5003, (300,), device="cuda", generator=g)
    y[::7] = -100

    def step(h, w, y):
        return fused_linear_cross_entropy(h, w, y, num_items_in_batch=torch.tensor(250))

    eager = step(h, w, y)
    ref = torch.autograd.grad(eager, (h, w))
    compiled = torch.compile(step, fullgraph=True)(h, w, y)
    got = torch.autograd.grad(compiled, (h, w))
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=0)
    for a, e in zip(got, ref):  # same kernels; only float32 atomics may reorder
        err = ((a.double() - e.double()).norm() / e.double().norm()).item()
        assert err <= 1e-3, err

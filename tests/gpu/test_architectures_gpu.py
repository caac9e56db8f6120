"""Patched vs stock at real sizes on a CUDA GPU for two swept types (marker ``gpu``).

Run: ``pytest -m gpu tests/gpu/test_architectures_gpu.py -q -s``. Random weights at the real
hidden size and vocabulary (fewer layers), bf16, 2 x 2048 tokens with padding. Both the stock
bf16 model and the patched bf16 model are compared with a float32 copy of the stock model; the
patched error must be no worse than stock's (times :data:`SLACK`, plus a small floor) for the
loss and for the gradients of the head, the embedding and every decoder parameter.
Qwen3 (no logit transform) and Granite (logit divisor ``logits_scaling``) are the two new types.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fused_ce_patch import apply_fused_ce

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLACK = 1.25
FLOOR = 2e-3  # bf16 rounding of the loss itself
TOKENS = (2, 2048)

CONFIGS = {
    # Qwen3-0.6B's widths (4 of its 28 layers), untied head.
    "qwen3": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=4096),
    # Granite-3.x-2B's widths (4 of its 40 layers) with its logit divisor.
    "granite": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=49155,
                    logits_scaling=8.0, embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.015625, tie_word_embeddings=True,
                    max_position_embeddings=4096),
}


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _build(model_type):
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = CONFIG_MAPPING[model_type](**CONFIGS[model_type], attn_implementation="sdpa")
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    torch.manual_seed(0)
    return cls(cfg).to("cuda", torch.float32).train()


def _batch(vocab):
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, vocab, TOKENS, device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[1, TOKENS[1] * 3 // 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()
                                       if p.grad is not None}


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_patched_matches_stock_at_real_size(model_type):
    from fused_ce_patch.hf import head as hf_forward

    ref32 = _build(model_type)
    stock = copy.deepcopy(ref32).to(torch.bfloat16)
    fused = copy.deepcopy(stock)
    apply_fused_ce(fused, backend="triton")
    batch = _batch(ref32.config.vocab_size)

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        loss32, g32 = _run(ref32, batch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    loss_s, g_s = _run(stock, batch)
    calls = []
    real = hf_forward.fused_linear_cross_entropy
    hf_forward.fused_linear_cross_entropy = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        loss_f, g_f = _run(fused, batch)
    finally:
        hf_forward.fused_linear_cross_entropy = real
    assert calls == [1], "the fused kernel did not run exactly once"

    rows = [("loss", rel(loss_f, loss32), rel(loss_s, loss32))]
    for name in g32:
        rows.append((name, rel(g_f[name], g32[name]), rel(g_s[name], g32[name])))
    print(f"\n{model_type}: {len(rows) - 1} gradients; worst 5 (fused vs stock error to fp32):")
    for name, ef, es in sorted(rows, key=lambda r: r[1] - SLACK * r[2], reverse=True)[:5]:
        print(f"  {name:60s} fused {ef:.2e}  stock bf16 {es:.2e}")
    bad = [(n, ef, es) for n, ef, es in rows if ef > SLACK * es + FLOOR]
    assert not bad, bad

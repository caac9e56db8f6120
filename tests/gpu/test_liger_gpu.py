"""fused_ce_patch with every non-loss Liger-Kernel kernel on a CUDA GPU (marker ``gpu``).

Run: ``pytest -m gpu tests/gpu/test_liger_gpu.py -q -s`` (needs ``liger-kernel``; skipped with
a reason without it). The CPU suite (``tests/hf/test_liger.py``) can only run Liger's RoPE under
the Triton interpreter; here RMSNorm, RoPE and SwiGLU (Llama) / GeGLU (Gemma 3) all run.

Small random float32 models (2 layers, vocab 32,003) with Liger's kernels applied to the
instance (``fused_linear_cross_entropy=False``) and ``apply_fused_ce``, against the same weights
with the same Liger kernels and transformers' own loss. Both sides run the identical Liger
kernels, so the only difference is the loss: our Triton kernel (IEEE float32 unless TF32 is
allowed) against ``ForCausalLMLoss`` over materialised float32 logits. Tolerances: loss 1e-5,
gradients 1e-4, as ``||a - b|| / ||b||`` (the CPU suite's).
"""

from __future__ import annotations

import copy
import functools
import importlib.util

import pytest
import torch
from module_state import kept

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None,
                       reason="liger-kernel not installed: pip install liger-kernel==0.8.5"),
]

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
VOCAB = 32003
MLP_FLAG = {"llama": "swiglu", "gemma3_text": "geglu"}


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _modules():
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama

    return {"llama": (modeling_llama, modeling_llama.LlamaForCausalLM),
            "gemma3_text": (modeling_gemma3, modeling_gemma3.Gemma3ForCausalLM)}


@pytest.fixture(autouse=True)
def _restore_transformers():
    """Liger patches module globals and classes process-wide even with ``model=``."""
    mods = _modules()
    with kept([m for m, _ in mods.values()], [c for _, c in mods.values()]):
        yield
    from fused_ce_patch import revert_fused_ce

    revert_fused_ce()


def _build(arch):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  attn_implementation="sdpa")
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False)
        cls = tf.LlamaForCausalLM
    else:
        cfg = tf.Gemma3TextConfig(**common, head_dim=64, sliding_window=128,
                                  layer_types=["sliding_attention", "full_attention"],
                                  query_pre_attn_scalar=64, final_logit_softcapping=30.0)
        cls = tf.Gemma3ForCausalLM
    torch.manual_seed(0)
    return cls(cfg).to("cuda", torch.float32).train()


def _apply_liger(arch, model):
    from liger_kernel.transformers import (
        apply_liger_kernel_to_gemma3_text,
        apply_liger_kernel_to_llama,
    )

    fn = apply_liger_kernel_to_llama if arch == "llama" else apply_liger_kernel_to_gemma3_text
    fn(rope=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=False,
       model=model, **{MLP_FLAG[arch]: True})


def _runs_liger(module) -> bool:
    forward = getattr(module.forward, "__func__", module.forward)
    return forward.__module__.startswith("liger_kernel")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_all_liger_non_loss_kernels_with_fused_ce(arch, monkeypatch):
    from fused_ce_patch import apply_fused_ce
    from fused_ce_patch.hf import head as hf_head
    from fused_ce_patch.hf import loss_mapping

    model = _build(arch)
    ref = copy.deepcopy(model)
    ref.loss_function = loss_mapping.original_causal_lm_loss()  # transformers' own loss
    _apply_liger(arch, model)
    _apply_liger(arch, ref)
    apply_fused_ce(model)
    for m in (model, ref):
        assert _runs_liger(m.model.norm) and _runs_liger(m.model.layers[0].mlp)
    modeling = _modules()[arch][0]
    assert modeling.apply_rotary_pos_emb.__module__.startswith("liger_kernel")

    calls = []
    kernel = hf_head.fused_linear_cross_entropy

    @functools.wraps(kernel)
    def spy(*args, **kwargs):
        calls.append(kwargs.get("backend"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(hf_head, "fused_linear_cross_entropy", spy)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 512), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[1, -64:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :32] = -100

    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    assert not calls
    got = model(input_ids=ids, attention_mask=mask, labels=labels)
    got.loss.backward()
    assert len(calls) == 1, "the fused loss did not run exactly once"

    err = rel(got.loss, want.loss)
    print(f"\n{arch}: loss {got.loss.item():.6f} vs {want.loss.item():.6f}, rel {err:.2e}")
    assert err <= LOSS_RTOL
    params = dict(model.named_parameters())
    ref_params = dict(ref.named_parameters())
    names = ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
             "model.layers.0.input_layernorm.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.0.self_attn.q_proj.weight"]
    for name in dict.fromkeys(n for n in names if n in params):
        e = rel(params[name].grad, ref_params[name].grad)
        print(f"  grad {name}: rel {e:.2e}")
        assert e <= GRAD_RTOL, f"{name}: {e:.2e}"

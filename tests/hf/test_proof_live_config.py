"""The proof on the user's own config (hf/live_config.py): what stock trains is patched.

Each type here was refused for a reason about our tiny-model builder (docs/support.md,
transformers 5.24.0: "tiny model: ..." or "stock forward: ..."), while a model the user builds
from a small config of their own trains stock on the CPU. Such a model is now proven on its own
config and patched, and then gives stock's loss and every gradient (float32).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

from fused_ce_patch import apply_fused_ce
from fused_ce_patch.hf import live_config, proof
from fused_ce_patch.hf.architectures import derive_spec
from fused_ce_patch.hf.sentinel import NotMaterializedLogits

# float32 model, the same ops on both sides up to the head: the fused loss and its gradients
# differ from stock only by the chunked logsumexp's rounding (measured <= 2e-6 relative).
LOSS_TOL, GRAD_TOL = 1e-5, 1e-5
GRAD_FLOOR = 1e-3  # as the proof: a gradient that is zero in exact arithmetic is noise

#: Small configs a user would write, for the types refused for the builder's reasons.
USER_CONFIGS = {
    "deepseek_v4": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
                        o_lora_rank=32, o_groups=2, moe_intermediate_size=32, n_routed_experts=4,
                        num_experts_per_tok=2, index_n_heads=4, index_head_dim=16, index_topk=8,
                        qk_rope_head_dim=8, sliding_window=8),
    "flint": dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, num_experts_per_tok=2, num_experts=4,
                  layer_types=["full_attention", "full_attention", "sliding_attention"],
                  head_dim=16),
    "doge": dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                 num_experts_per_tok=2),
    "gpt_neo": dict(vocab_size=500, hidden_size=64, num_layers=2, num_heads=4,
                    attention_types=[[["global", "local"], 1]], bos_token_id=1, eos_token_id=2),
    "helium": dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, head_dim=16),
    "zaya": dict(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 moe_intermediate_size=32, num_experts=4, layer_types=["hybrid", "hybrid"],
                 head_dim=16),
    "mamba2": dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
                   expand=2, state_size=16, n_groups=1, chunk_size=16),
    "cohere_compass_text": dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1,
        eos_token_id=2, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "dbrx": dict(vocab_size=300, d_model=64, n_heads=4, n_layers=2, max_seq_len=64,
                 attn_config={"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}),
    "lfm2_moe": dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                     moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, num_dense_layers=1, num_experts=4,
                     num_experts_per_tok=2, layer_types=["conv", "full_attention", "conv"]),
    "zamba": dict(vocab_size=300, hidden_size=64, attention_hidden_size=128,
                  intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  attention_head_dim=32, num_key_value_heads=4, n_mamba_heads=2,
                  mamba_dt_rank=8, attn_layer_period=2, attn_layer_offset=1,
                  use_mamba_kernels=False,
                  layers_block_type=["linear_attention", "hybrid", "linear_attention",
                                     "hybrid"]),
    "zamba2": dict(vocab_size=300, hidden_size=64, num_hidden_layers=3,
                   layers_block_type=["linear_attention", "hybrid", "linear_attention"],
                   hybrid_layer_ids=[1], mamba_d_state=16, n_mamba_heads=4, mamba_headdim=32,
                   chunk_size=16, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=4, use_mamba_kernels=False),
    # per-layer attention configs (sliding layers take the swa_* values), MLA, an indexer
    "dots3_note_text": dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=32, head_dim=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, index_topk=8, index_head_dim=16,
        index_n_heads=4, shared_experts_intermediate_size=32, sliding_window=8,
        swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=32,
        swa_kv_lora_rank=32, swa_head_dim=32, swa_qk_nope_head_dim=16, swa_v_head_dim=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma3n_text": dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        num_kv_shared_layers=2, vocab_size_per_layer_input=300, hidden_size_per_layer_input=16,
        laurel_rank=8, activation_sparsity_pattern=[0.0] * 4, altup_num_inputs=2,
        sliding_window=8, pad_token_id=0, bos_token_id=2, eos_token_id=1),
}


pytestmark = pytest.mark.usefixtures("fresh_proofs")  # tests/hf/conftest.py


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {k: None if p.grad is None else p.grad.detach().clone()
             for k, p in model.named_parameters()}
    return out, out.loss.detach().clone(), grads


def _batch(config):
    vocab = config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(vocab, 1000), (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("model_type", sorted(USER_CONFIGS))
def test_a_model_stock_trains_is_patched_and_matches_stock(model_type):
    config = AutoConfig.for_model(model_type, **USER_CONFIGS[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    batch = _batch(config)
    _, want_loss, want_grads = _loss_and_grads(model, batch)  # stock trains here
    assert torch.isfinite(want_loss)
    apply_fused_ce(model, backend="torch")
    (row,) = proof._MEMO.values()
    assert row["status"] == "pass" and row["config"].startswith("your config"), row
    out, loss, grads = _loss_and_grads(model, batch)
    assert isinstance(out.logits, NotMaterializedLogits)  # the fused path ran
    assert abs(loss - want_loss) <= LOSS_TOL * abs(want_loss), (loss, want_loss)
    floor = GRAD_FLOOR * max(g.norm() for g in want_grads.values() if g is not None)
    for name, want in want_grads.items():
        got = grads[name]
        assert (got is None) == (want is None), name
        if want is not None:
            err = (got - want).norm() / max(want.norm(), floor)
            assert err <= GRAD_TOL, (name, err.item())


def test_the_deepseek_v4_refusal_of_the_issue(caplog):
    """transformers 5.25.0's DeepSeek-V4 from a small config: stock trains; the class default
    cannot run stock (its router returns no logits with output_router_logits on), so the
    proof runs on the user's config and names what it fell back from."""
    config = AutoConfig.for_model("deepseek_v4", **USER_CONFIGS["deepseek_v4"])
    cls = transformers.DeepseekV4ForCausalLM
    default_row = proof.prove(cls, derive_spec(cls), "deepseek_v4")
    assert default_row["status"] == "unbuildable" and "IndexError" in default_row["reason"]
    row = proof.prove(cls, derive_spec(cls), "deepseek_v4", config=config)
    assert row["status"] == "pass" and row["config"] == "your config", row
    assert "router logits on" in row["fallback_from"]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_moe", "deepseek_v3",
                                        "mamba2", "gemma3n_text", "deepseek_v4", "helium",
                                        "gemma2", "granitemoe"])
def test_a_large_config_is_proven_shrunk_with_its_structure(model_type):
    """A full-size config (the class default: 7B-class widths) is proven on a shrunk copy:
    small, with its layer-type pattern, softcaps, scales and tying kept (DeepSeek-V4, Helium,
    Mamba-2 and Gemma-3n's defaults did not build or run through the sweep's tiny builder)."""
    config = CONFIG_MAPPING[model_type]()
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    small = live_config.shrunk(config)
    assert small.hidden_size == 64 and small.vocab_size == 1000
    for key in ("final_logit_softcapping", "logits_scaling", "tie_word_embeddings",
                "query_pre_attn_scalar", "attn_logit_softcapping"):
        assert getattr(small, key, None) == getattr(config, key, None), key
    if getattr(config, "layer_types", None):
        assert set(small.layer_types) == set(config.layer_types)
        assert small.layer_types == config.layer_types[:len(small.layer_types)]
    row = proof.prove(cls, derive_spec(cls), model_type, config=config)
    assert row["status"] == "pass" and row["config"].startswith("your config, shrunk"), row


def test_the_class_default_is_the_fallback(monkeypatch):
    def broken(config, depth=0):
        raise ValueError("cannot shrink this one")

    monkeypatch.setattr(live_config, "shrunk", broken)
    config = transformers.LlamaConfig()  # too large to prove as it is
    cls = transformers.LlamaForCausalLM
    row = proof.prove(cls, derive_spec(cls), "llama", config=config)
    assert row["status"] == "pass" and row["config"] == "the class's default config", row
    assert "cannot shrink this one (your config, shrunk)" in row["fallback_from"]


def test_proofs_are_kept_per_config_fact(monkeypatch):
    """Same class, same config: proven once; a config differing in a fact the loss depends on
    (a softcap): proven again; the disk key follows the config too."""
    calls = []
    real = proof.prove
    monkeypatch.setattr(proof, "prove", lambda *a, **k: calls.append(k.get("config")) or
                        real(*a, **k))
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    one = transformers.Gemma2Config(**base, final_logit_softcapping=30.0)
    two = transformers.Gemma2Config(**base, final_logit_softcapping=5.0)
    for config in (one, copy.deepcopy(one), two):
        torch.manual_seed(0)
        model = transformers.Gemma2ForCausalLM(config).train()
        apply_fused_ce(model, backend="torch")
    assert len(calls) == 2
    spec = derive_spec(transformers.Gemma2ForCausalLM)
    keys = {proof.disk_key(transformers.Gemma2ForCausalLM, spec, "gemma2", c)
            for c in (one, copy.deepcopy(one), two, None)}
    assert len(keys) == 3 and None not in keys


def test_a_config_on_which_the_patch_steps_aside_proves_the_fused_path_elsewhere():
    """Gemma-2 with a negative softcap: the patched forward takes the stock path (stock's
    numbers, checked) on the user's config, so the fused path is proven on the class default;
    a patched copy that differed on the stock path would be refused."""
    config = transformers.Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16,
                                       final_logit_softcapping=-3.0)
    cls = transformers.Gemma2ForCausalLM
    row = proof.prove(cls, derive_spec(cls), "gemma2", config=config)
    assert row["status"] == "pass" and row["config"] == "the class's default config", row
    assert "took the stock path, as stock (your config)" in row["fallback_from"]


def test_encoder_decoder_head_counts_shrink_with_the_width():
    # PLBart / Whisper map num_attention_heads to the encoder's count only: the decoder's 12
    # heads would not divide a width of 64 (a proof that then needed the 100M as-is model,
    # whose memory check made the sweep depend on the machine's free memory)
    config = AutoConfig.for_model("plbart")
    small = live_config.shrunk(config)
    assert small.decoder_attention_heads == small.encoder_attention_heads == live_config.HEADS
    assert small.d_model % small.decoder_attention_heads == 0


def test_available_memory_counts_the_reclaimable_page_cache():
    import os

    available = live_config._available_bytes()
    free_pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert available is not None and available >= free_pages * 0.9  # MemAvailable >= MemFree

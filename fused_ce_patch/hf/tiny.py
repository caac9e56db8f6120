"""Tiny random models of any causal-LM type, and the batches a parity check runs on them.

Shared by the proof that runs before a class is patched (:mod:`.proof`) and the parity sweep
over transformers' registry (:mod:`.sweep`): the config class's defaults shrunk (2 layers,
hidden 64, 4 heads, 4 experts, vocab 1000, no dropout; :data:`OVERRIDES` per type only where
needed), and three batches — a padded one, one with ``num_items_in_batch``, one with
``shift_labels``.
"""

from __future__ import annotations

import copy

VOCAB = 1000

#: Shrunk values, applied to every config (and sub-config) that has the attribute.
SHRINK = {
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "ffn_hidden_size": 128,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_group": 1, "topk_group": 1,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "vocab_size": VOCAB,
    # Gemma-4's per-layer input embeddings (262144 x ... by default: 135M parameters, 80 s of
    # proof at apply time)
    "vocab_size_per_layer_input": VOCAB,
    "max_position_embeddings": 256, "n_positions": 256,
    # state-space / linear-attention layers (their torch fallbacks are slow at default sizes)
    "mamba_n_heads": 8, "mamba_d_state": 16, "mamba_chunk_size": 16, "mamba_d_ssm": 128,
    "linear_num_heads": 4, "linear_head_dim": 16, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "state_size": 16, "ssm_state_size": 16, "chunk_size": 16, "shared_intermediate_size": 64,
    "output_router_logits": True,
    "router_jitter_noise": 0.0,
    "use_cache": False,
}

#: Per-type config overrides (only where the shrunk defaults do not build or run), merged
#: into the shrunk kwargs (nested dicts merged key by key).
_MROPE = {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [2, 3, 3]}}}
_DOTS3 = {
    "num_hidden_layers": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "head_dim": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "index_topk": 8,
    "index_head_dim": 16, "index_n_heads": 4, "sliding_window": 8,
    "num_attention_heads": 4, "num_key_value_heads": 4, "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 4, "swa_q_lora_rank": 32, "swa_kv_lora_rank": 32,
    "swa_head_dim": 32, "swa_qk_nope_head_dim": 16, "swa_v_head_dim": 16,
}
OVERRIDES: dict[str, dict] = {
    "qwen2_vl": _MROPE, "qwen2_5_vl": _MROPE, "glm4v": _MROPE,
    # its LM head model asserts a decoder config; axial position embeddings and LSH attention
    # need sequence lengths of their own factors (a 12-token batch: plain positions, local)
    "reformer": {"is_decoder": True, "axial_pos_embds": False, "attn_layers": ["local", "local"],
                 "local_attn_chunk_length": 4},
    # X-MOD routes every layer through a per-language adapter: stock asks for one
    "xmod": {"default_language": "en_XX"},
    # dots3: per-layer attention configs (sliding layers from the swa_* values), MLA and an
    # indexer, whose defaults do not shrink with the global sizes
    "dots3_note_text": _DOTS3,
    # GIT: a 32-pixel image of 16-pixel patches (5 image positions before the text)
    "git": {"vision_config": {"image_size": 32, "patch_size": 16}},
}


#: Types whose text positions follow the image's, with no placeholder tokens in ``input_ids``:
#: their loss drops the image positions, so a text-only batch leaves nothing to score. The
#: proof's batches carry random ``pixel_values`` of the vision config's size for them.
IMAGE_PREFIX = ("git",)


def _merge(into: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


#: Multimodal ``...ForConditionalGeneration`` types outside the causal-LM registry (from the
#: image-text-to-text registry) whose text path ends in the same head; swept on text batches.
MULTIMODAL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "mistral3",
              "glm4v", "idefics3", "smolvlm", "internvl", "aya_vision", "lfm2_vl")


def registry() -> dict[str, str]:
    """``model_type -> class name``: the causal-LM registry plus :data:`MULTIMODAL`."""
    from transformers.models.auto import modeling_auto as auto

    out = dict(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    for model_type in MULTIMODAL:
        name = auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
        if name is not None and model_type not in out:
            out[model_type] = name
    return out


def _special_ids(config, out=None, depth=0):
    out = set() if out is None else out
    for key, value in vars(config).items():
        if key.endswith(("_token_id", "_token_index", "_id")) and isinstance(value, int):
            out.add(value)
        elif hasattr(value, "to_dict") and depth < 3:
            _special_ids(value, out, depth + 1)
    return out


def _has(obj, key) -> bool:
    try:
        return hasattr(obj, key)
    except Exception:  # noqa: BLE001 - e.g. per-layer attributes that refuse a global read
        return False


def _shrink_kwargs(config_cls, model_type, depth=0):
    default = config_cls()
    kwargs = {k: v for k, v in SHRINK.items() if k in vars(default) or _has(default, k)}
    heads = getattr(default, "num_attention_heads", None) if _has(
        default, "num_attention_heads") else None
    kv = vars(default).get("num_key_value_heads")
    if kv is not None and heads is not None and kv >= heads:
        kwargs["num_key_value_heads"] = SHRINK["num_attention_heads"]  # MHA / MLA stay MHA
    if "head_dim" in vars(default) and vars(default)["head_dim"] is None:
        kwargs["head_dim"] = SHRINK["hidden_size"] // SHRINK["num_attention_heads"]
    rope = vars(default).get("rope_parameters")
    if isinstance(rope, dict) and rope.get("mrope_section") and "head_dim" not in kwargs:
        # multimodal RoPE sections must sum to head_dim / 2 of the shrunk model
        half = SHRINK["hidden_size"] // SHRINK["num_attention_heads"] // 2
        section = list(rope["mrope_section"])
        scaled = [max(1, round(x * half / sum(section))) for x in section]
        scaled[0] += half - sum(scaled)
        kwargs["rope_parameters"] = {**rope, "mrope_section": scaled}
    if vars(default).get("rotary_dim"):
        kwargs["rotary_dim"] = 8
    if "n_shared_experts" in vars(default) and not vars(default)["n_shared_experts"]:
        kwargs["n_shared_experts"] = 1
    for key, value in vars(default).items():
        if "dropout" in key or key.endswith("_pdrop") or key == "attention_dropout":
            if isinstance(value, float):
                kwargs[key] = 0.0
        elif hasattr(value, "to_dict") and hasattr(value, "__class__") and key.endswith("config"):
            kwargs[key] = _shrink_kwargs(type(value), model_type, depth + 1)
    # token ids beyond the shrunk vocab would index past the embedding
    for key, value in vars(default).items():
        if key.endswith("_token_id") and isinstance(value, int) and value >= VOCAB:
            kwargs[key] = VOCAB - 1 - (hash(key) % 16)
    if depth == 0:
        _merge(kwargs, copy.deepcopy(OVERRIDES.get(model_type, {})))
    return kwargs


def tiny_config(model_type: str):
    """A tiny random-initialisable config for ``model_type`` (see module docstring)."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    kwargs = _shrink_kwargs(config_cls, model_type)
    sub = {k: v for k, v in kwargs.items() if isinstance(v, dict)}
    flat = {k: v for k, v in kwargs.items() if not isinstance(v, dict)}
    config = config_cls(**flat, **{k: v for k, v in sub.items()})
    _fix_layer_lists(config)
    config._attn_implementation = "eager"
    return config


def _fix_layer_lists(config, depth=0):
    n = getattr(config, "num_hidden_layers", None)
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and n and key in ("layer_types", "layers_block_type",
                                                     "block_types") and len(value) > n:
            setattr(config, key, value[:n])
        elif hasattr(value, "to_dict") and depth < 3:
            _fix_layer_lists(value, depth + 1)
    for sub in ("text_config", "vision_config", "audio_config"):
        if hasattr(config, sub) and getattr(config, sub) is not None:
            try:
                getattr(config, sub)._attn_implementation = "eager"
            except Exception:  # noqa: BLE001 - some sub-configs are plain dicts
                pass


def _vocab(config) -> int:
    """The text vocabulary of ``config`` (at most :data:`VOCAB`: the ids drawn)."""
    try:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
    except Exception:  # noqa: BLE001 - a composite config without a text part
        text = config
    vocab = getattr(text, "vocab_size", None)
    return min(VOCAB, vocab) if isinstance(vocab, int) and vocab > 0 else VOCAB


def _batches(config, torch):
    special = _special_ids(config)
    allowed = torch.tensor([i for i in range(_vocab(config)) if i not in special])
    g = torch.Generator().manual_seed(0)
    ids = allowed[torch.randint(0, len(allowed), (2, 12), generator=g)]
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding on the second row
    labels = ids.masked_fill(mask == 0, -100)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    other = allowed[torch.randint(0, len(allowed), (2, 12), generator=g)]
    counted = int((shifted != -100).sum())
    batches = {
        "padded": {"input_ids": ids, "attention_mask": mask, "labels": labels},
        "num_items_in_batch": {"input_ids": ids, "attention_mask": mask, "labels": labels,
                               "num_items_in_batch": torch.tensor(counted + 5)},
        # shift_labels wins over labels in ForCausalLMLoss; unrelated labels prove it
        "shift_labels": {"input_ids": ids, "attention_mask": mask, "labels": other,
                         "shift_labels": shifted},
    }
    vision = getattr(config, "vision_config", None)
    if getattr(config, "model_type", None) in IMAGE_PREFIX and vision is not None:
        size, channels = vision.image_size, getattr(vision, "num_channels", 3)
        pixels = torch.randn(2, channels, size, size, generator=g)
        for batch in batches.values():
            batch["pixel_values"] = pixels
    return batches

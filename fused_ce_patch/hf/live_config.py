"""The proof's model from the live model's own config (:mod:`.proof`).

A tiny model built from the class's *default* config proves the class, but it is our builder's
model, not the user's: a default that does not build or run on the CPU (DeepSeek-V4's router
logits, a per-layer setting the shrinker gets wrong) refused a model the user had built and
trains. So the proof of an instance runs on a copy of that instance's ``config``:

* as it is, when a model of it has at most :data:`AS_IS_PARAMS` parameters (the cost of the
  proof is then that of two such models and their gradients in float64, 32 bytes a
  parameter: at the limit 0.16 GB and about a second of CPU; measured on a 2-core machine,
  a 22M-parameter Llama config as is took 3.75 s, its shrunk copy 0.1 s);
* else shrunk (:func:`shrunk`): fewer layers (a prefix long enough to hold every distinct
  layer type, per-layer lists cut to it), narrower widths (hidden 64, heads 4, key/value
  heads in the same ratio class: MHA stays MHA, GQA/MQA stay grouped), fewer experts
  (4, top-2), a vocabulary of 1000; every other setting (layer types, MoE/MLA/hybrid
  settings, tying, softcaps, scales) is the user's;
* and where the shrunk copy does not build or run, as it is again up to
  :data:`LARGE_AS_IS_PARAMS` parameters when twice its 32 bytes a parameter are free (3.2 GB
  and tens of seconds of CPU at the limit): before the class default, which is not the
  user's model.

Both drop dropout, the KV cache and take eager attention (the proof compares stock and patched
on the same decoder; what it tests is the head and the loss). Each is built on the meta device
first, so nothing large is ever allocated. The class-default tiny model (:mod:`.tiny`) remains
the fallback, and the only model for a class-level patch (no instance).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os

import torch

__all__ = ["candidates", "shrunk", "fingerprint", "AS_IS_PARAMS"]

#: A live config is proven as it is up to this many parameters (see the module docstring).
AS_IS_PARAMS = 5_000_000
#: Where the shrunk copy does not build or run, the config as is up to this many parameters
#: when memory allows (about 32 bytes a parameter and seconds to tens of seconds of CPU).
LARGE_AS_IS_PARAMS = 100_000_000
#: Its shrunk copy must come under this (a guard: nothing large is allocated).
SHRUNK_PARAMS = 25_000_000

VOCAB = 1000
HIDDEN, HEADS, HEAD_DIM = 64, 4, 16
_WIDTHS = {
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "ffn_hidden_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 64,
    "q_lora_rank": 32, "kv_lora_rank": 32, "o_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
    "mamba_d_state": 16, "mamba_chunk_size": 16, "state_size": 16, "ssm_state_size": 16,
    "chunk_size": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8,
}
_HEADS = ("num_attention_heads", "n_head", "n_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k")
_LAYER_LISTS = ("layer_types", "layers_block_type", "block_types", "mlp_layer_types")


def _sub_configs(config):
    return [v for k, v in vars(config).items() if k.endswith("config") and hasattr(v, "to_dict")]


def _prepare(config, depth=0):
    """No dropout, no KV cache, eager attention (in place; sub-configs too)."""
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or key.endswith("_pdrop")):
            setattr(config, key, 0.0)
    if "use_cache" in vars(config):
        config.use_cache = False
    try:
        config._attn_implementation = "eager"
    except Exception:  # noqa: BLE001 - a sub-config that refuses it keeps its own
        pass
    if depth < 3:
        for sub in _sub_configs(config):
            _prepare(sub, depth + 1)
    return config


def _put(config, key, value):
    """Set without the config's per-assignment validation (a strict dataclass checks each
    field against the others as it is set; the shrunk copy is consistent only when done)."""
    object.__setattr__(config, key, value)


def _get(config, key):
    return vars(config).get(key)


def _set_if_larger(config, key, value):
    old = _get(config, key)
    if isinstance(old, int) and not isinstance(old, bool) and old > value:
        _put(config, key, value)
    elif isinstance(old, list) and old and all(isinstance(v, int) and not isinstance(v, bool)
                                               for v in old):
        _put(config, key, [min(v, value) for v in old])  # a per-layer width


def _shrink_layers(config):
    key = next((k for k in _LAYERS if isinstance(_get(config, k), int)), None)
    if key is None:
        return
    n = _get(config, key)
    types = next((_get(config, k) for k in _LAYER_LISTS if isinstance(_get(config, k), list)
                  and len(_get(config, k)) == n), None)
    keep = 2
    if types:
        seen = set()
        for i, t in enumerate(types):  # the shortest prefix with every distinct layer type
            if t not in seen:
                seen.add(t)
                keep = max(keep, i + 1)
    shared = _get(config, "num_kv_shared_layers")
    if isinstance(shared, int) and 0 < shared < n:
        # Gemma-3n: the last layers reuse the KV of earlier ones of their type; as many
        # shared as owning ones, each half holding every layer type
        keep *= 2
    keep = min(n, keep)
    if keep >= n:
        return
    if isinstance(shared, int) and 0 < shared < n:
        _put(config, "num_kv_shared_layers", keep // 2)
    _put(config, key, keep)
    for k, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == n:
            _put(config, k, value[:keep])  # per-layer settings
        elif (isinstance(value, list) and k.endswith("_layers") and value
              and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
            _put(config, k, [i for i in value if i < keep] or value[:1])  # layer indices
    if isinstance(_get(config, "first_k_dense_replace"), int) and config.first_k_dense_replace:
        _put(config, "first_k_dense_replace", min(config.first_k_dense_replace, keep - 1))


def _shrink_heads(config):
    for key in ("encoder_attention_heads", "decoder_attention_heads"):
        # encoder-decoder configs (num_attention_heads an alias of the encoder's count)
        if isinstance(_get(config, key), int) and _get(config, key) > HEADS:
            _put(config, key, HEADS)
    hkey = next((k for k in _HEADS if isinstance(_get(config, k), int)), None)
    if hkey is None:
        return
    heads = _get(config, hkey)
    if heads <= HEADS:
        new = heads
    else:
        new = HEADS
        _put(config, hkey, new)
    kvkey = next((k for k in _KV_HEADS if isinstance(_get(config, k), int)), None)
    if kvkey is not None:
        kv = _get(config, kvkey)
        if kv >= heads:
            _put(config, kvkey, new)  # MHA (and MLA) stay MHA
        elif kv == 1:
            pass  # MQA stays MQA
        else:
            _put(config, kvkey, 2 if new % 2 == 0 and new > 2 else 1)
    head_dim = _get(config, "head_dim")
    if isinstance(head_dim, int) and head_dim > HEAD_DIM:
        _put(config, "head_dim", HEAD_DIM)


def _shrink_ssm_heads(config, before):
    """Mamba-2's ``num_heads * head_dim == expand * hidden_size`` kept where it held."""
    heads, dim, expand = (vars(config).get(k) for k in ("num_heads", "head_dim", "expand"))
    hidden = vars(config).get("hidden_size")
    if not all(isinstance(v, int) for v in (heads, dim, expand, hidden)):
        return
    if before.get("num_heads", 0) * before.get("head_dim", 0) == \
            before.get("expand", 0) * before.get("hidden_size", -1) and \
            (expand * hidden) % dim == 0:
        _put(config, "num_heads", expand * hidden // dim)
        groups = vars(config).get("n_groups")
        if isinstance(groups, int) and groups > 1 and config.num_heads % groups:
            _put(config, "n_groups", 1)


def _shrink_experts(config):
    ekey = next((k for k in _EXPERTS if isinstance(_get(config, k), int)), None)
    if ekey is None or _get(config, ekey) <= 4:
        return
    _put(config, ekey, 4)
    for k in _TOP_K:
        _set_if_larger(config, k, 2)
    for k in ("n_group", "topk_group"):
        _set_if_larger(config, k, 1)


def _shrink_vocab(config):
    vocab = _get(config, "vocab_size")
    if not isinstance(vocab, int) or vocab <= VOCAB:
        return
    _put(config, "vocab_size", VOCAB)
    for key, value in list(vars(config).items()):
        if key.endswith(("_token_id", "_token_index")) and isinstance(value, int) \
                and value >= VOCAB:
            _put(config, key, VOCAB - 1 - (int(hashlib.sha256(key.encode()).hexdigest(), 16)
                                              % 16))
        elif key.endswith("_token_id") and isinstance(value, list):
            _put(config, key, [v if v < VOCAB else VOCAB - 1 for v in value])


def _shrink_rope(config):
    rope = _get(config, "rope_parameters")
    half = (_get(config, "head_dim") or HIDDEN // HEADS) // 2
    if isinstance(rope, dict) and rope.get("mrope_section"):
        section = list(rope["mrope_section"])
        if sum(section) != half:
            scaled = [max(1, round(x * half / sum(section))) for x in section]
            scaled[0] += half - sum(scaled)
            _put(config, "rope_parameters", {**rope, "mrope_section": scaled})
    if isinstance(_get(config, "rotary_dim"), int) and config.rotary_dim > 8:
        _put(config, "rotary_dim", 8)


def shrunk(config, depth: int = 0):
    """A copy of ``config`` with its sizes shrunk and its structure kept (module docstring)."""
    config = copy.deepcopy(config) if depth == 0 else config
    if depth < 3:
        for sub in _sub_configs(config):
            shrunk(sub, depth + 1)
    _shrink_layers(config)
    before = {k: v for k, v in vars(config).items() if isinstance(v, int)}
    for key, value in _WIDTHS.items():
        _set_if_larger(config, key, value)
    _shrink_heads(config)
    # a head_dim that was another width (MLA's head_dim is its rope part) stays that width
    for key in ("qk_rope_head_dim", "v_head_dim"):
        if "head_dim" in before and before["head_dim"] == before.get(key) and \
                isinstance(vars(config).get("head_dim"), int):
            _put(config, "head_dim", vars(config)[key])
            break
    _shrink_ssm_heads(config, before)
    _shrink_experts(config)
    _shrink_vocab(config)
    _shrink_rope(config)
    return config


def _meta_params(cls: type, config) -> int:
    with torch.device("meta"):
        model = cls(config)
    return sum(p.numel() for p in model.parameters())


def _looks_small(config) -> bool:
    """No meta build of a config whose text part is obviously large (it takes seconds)."""
    try:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
    except Exception:  # noqa: BLE001
        text = config
    hidden = next((v for k in ("hidden_size", "n_embd", "d_model")
                   if isinstance(v := vars(text).get(k), int)), 0)
    layers = next((v for k in _LAYERS if isinstance(v := vars(text).get(k), int)), 0)
    return hidden <= 1024 and layers <= 24


def _available_bytes() -> int | None:
    """Memory a new allocation can get now: Linux's ``MemAvailable`` (free pages plus the page
    cache it can reclaim), else the free pages alone."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _fits_in_memory(params: int) -> bool:
    """Two float64 copies and their gradients (``32 * params`` bytes) fit twice over in the
    memory free now (unknown: no)."""
    free = _available_bytes()
    return free is not None and 64 * params <= free


def _router_logits_on(config) -> list[tuple[str, object]]:
    """``config`` with ``output_router_logits`` on where it is off: a call may turn it on
    (``model(..., output_router_logits=True)``), so the aux-loss branch is proven first; where
    the stock model cannot run with it (a router that returns no logits), the next candidate
    is the config as it is."""
    if vars(config).get("output_router_logits") is not False:
        return []
    on = copy.deepcopy(config)
    on.output_router_logits = True
    return [("your config, router logits on", on)]


def candidates(cls: type, config) -> list[tuple[str, object]]:
    """``(label, config)`` to prove ``cls`` on, best first, from a live model's ``config``:
    ``"your config"`` (as is) when a model of it has at most :data:`AS_IS_PARAMS` parameters;
    else ``"your config, shrunk"`` (:func:`shrunk`), then ``"your config"`` as is when it has
    at most :data:`LARGE_AS_IS_PARAMS` and fits in free memory (:func:`_fits_in_memory`).
    Empty when none fits (the caller falls back to the class default). Never raises."""
    out = []
    try:
        mine = _prepare(copy.deepcopy(config))
    except Exception:  # noqa: BLE001 - a config that cannot be copied
        return out
    params = None
    try:
        if _looks_small(mine):
            params = _meta_params(cls, mine)
            if params <= AS_IS_PARAMS:
                return [*_router_logits_on(mine), ("your config", mine)]
    except Exception:  # noqa: BLE001 - the build's error shows again on the shrunk copy
        pass
    try:
        small = shrunk(mine)
        if _meta_params(cls, small) <= SHRUNK_PARAMS:
            out.append(("your config, shrunk", small))
    except Exception as exc:  # noqa: BLE001
        out.append(("your config, shrunk", exc))
    if params is not None and params <= LARGE_AS_IS_PARAMS and _fits_in_memory(params):
        out.append(("your config", mine))
    return out


_VOLATILE = ("_name_or_path", "transformers_version", "architectures", "_commit_hash",
             "torch_dtype", "dtype", "auto_map")


def fingerprint(config) -> str | None:
    """sha256 of ``config``'s settings (names, versions and dtype left out), or None."""
    if config is None:
        return None
    try:
        data = config.to_dict()
    except Exception:  # noqa: BLE001
        return None

    def clean(d):
        return {k: clean(v) if isinstance(v, dict) else v for k, v in d.items()
                if k not in _VOLATILE}

    try:
        text = json.dumps(clean(data), sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()

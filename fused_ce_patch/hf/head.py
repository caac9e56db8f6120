"""The lm_head as the fused loss sees it: ``(hidden, weight, bias)`` with every adapter included.

The fused loss never calls ``lm_head(hidden)``; it reads the weight. That is only correct when
the weight *is* what the head computes. This module resolves the head module returned by
``model.get_output_embeddings()`` on every call (FSDP, PEFT and accelerate replace modules after
patching) into operands of one linear map:

- plain ``nn.Linear``: ``(h, W, b)``;
- PEFT ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``): the active trainable copy,
  or the frozen original while adapters are disabled — the same module the wrapper's own
  forward would call;
- PEFT LoRA on the head (``lora.Linear``): ``h·Wᵀ + s·(drop(h)·Aᵀ)·Bᵀ`` folded exactly into one
  linear map by concatenation, ``[h | s·drop(h)·Aᵀ] · [W | B]ᵀ``, so the adapter receives its
  gradient through the fused kernel (one extra ``[V, H + r]`` weight copy per step, no logits);
- anything else (DoRA or other LoRA variants, other PEFT tuners, quantised or custom heads,
  heads with forward hooks) raises :class:`~fused_ce_patch.errors.UnsupportedModelError`
  instead of silently training without the adapter.

Source: PEFT 0.21 ``tuners/lora/layer.py`` (``Linear.forward``) and ``utils/other.py``
(``ModulesToSaveWrapper``) for what each wrapper computes; the concatenation is this project's.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..errors import UnsupportedModelError

_ESCAPE = (
    "Train this model without the fused loss (apply_fused_ce(model, return_logits=True)), or "
    "keep lm_head a plain nn.Linear (PEFT: modules_to_save=['lm_head'] or plain LoRA)."
)


def _peft_classes():
    """PEFT wrapper classes, or None when PEFT was never imported (then no head is wrapped)."""
    if "peft" not in sys.modules:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # older PEFT: ModulesToSaveWrapper was the only wrapper
        AuxiliaryTrainingWrapper = ModulesToSaveWrapper
    from peft.tuners.lora.layer import Linear as LoraLinear

    return BaseTunerLayer, AuxiliaryTrainingWrapper, ModulesToSaveWrapper, LoraLinear


def _check_no_hooks(module: nn.Module, name: str):
    # Hooks (PEFT's mixed-batch adapter_names, ZeRO-3 gathering, user hooks) run only when the
    # module is called; reading its weight would silently skip them.
    if module._forward_pre_hooks or module._forward_hooks:
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}) has forward hooks, which the fused loss would "
            f"bypass because it reads the weight instead of calling the module. {_ESCAPE}"
        )
    if "forward" in module.__dict__ and not hasattr(module, "_hf_hook"):
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}) has a replaced forward on the instance, which the "
            f"fused loss would bypass. {_ESCAPE}"
        )


def _plain_linear(module: nn.Module, name: str):
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        raise UnsupportedModelError(
            f"{name} is a {type(module).__module__}.{type(module).__qualname__}; the fused loss "
            f"supports a plain torch.nn.Linear head (also inside PEFT modules_to_save or LoRA), "
            f"because it reads the weight instead of calling the module. {_ESCAPE}"
        )
    _check_no_hooks(module, name)
    weight = module.weight
    if weight.device.type == "meta":
        raise UnsupportedModelError(
            f"{name}.weight is on the meta device (offloaded by a device_map?); the fused loss "
            f"needs the materialised weight. {_ESCAPE}"
        )
    return weight, module.bias


def _active_module_to_save(wrapper):
    # Mirrors the wrapper's own forward: the original module while adapters are disabled or
    # none is active, else the copy of the first active adapter.
    if wrapper.disable_adapters or not wrapper.active_adapters:
        return wrapper.original_module, "original_module"
    name = wrapper.active_adapters[0]
    return wrapper.modules_to_save[name], f"modules_to_save[{name!r}]"


def check_head(head: nn.Module, name: str = "lm_head") -> None:
    """Raise now if :func:`head_operands` would refuse ``head`` (used at apply time).

    Raises:
        UnsupportedModelError: the head cannot be expressed as one linear map here.
    """
    _resolve(head, name, check_only=True)


def head_operands(head: nn.Module, hidden: torch.Tensor, name: str = "lm_head"):
    """``(hidden, weight, bias)`` such that ``hidden @ weight.T + bias`` equals ``head(hidden)``.

    Args:
        head: the module returned by ``model.get_output_embeddings()``.
        hidden: ``[..., H]`` last hidden states already sliced by ``logits_to_keep``.
        name: how error messages name the head.

    Returns:
        ``hidden`` ``[..., H]`` (``[..., H + r]`` with LoRA adapters, the low-rank inputs
        appended), ``weight`` ``[V, H]`` (``[V, H + r]``), and ``bias`` ``[V]`` or None.
        Adapter dropout is applied here, so call this once per forward.

    Raises:
        UnsupportedModelError: DoRA/variants, other PEFT tuners, trainable-token wrappers,
            quantised or custom heads, heads with forward hooks, meta-device weights.
    """
    return _resolve(head, name, hidden=hidden)


def _resolve(head, name, hidden=None, check_only=False):
    peft = _peft_classes()
    if peft is not None:
        base_tuner, aux_wrapper, modules_to_save_cls, lora_linear = peft
        if isinstance(head, modules_to_save_cls):
            _check_no_hooks(head, name)
            inner, which = _active_module_to_save(head)
            return _resolve(inner, f"{name}.{which}", hidden, check_only)
        if isinstance(head, aux_wrapper):
            raise UnsupportedModelError(
                f"{name} is wrapped by PEFT's {type(head).__name__} (e.g. trainable_token_indices "
                f"on a tied head), whose weight is not a plain parameter. {_ESCAPE}"
            )
        if isinstance(head, lora_linear):
            return _lora(head, name, hidden, check_only)
        if isinstance(head, base_tuner):
            raise UnsupportedModelError(
                f"{name} is a PEFT {type(head).__module__}.{type(head).__name__} layer; only "
                f"plain LoRA (lora.Linear) on the head is folded into the fused loss. {_ESCAPE}"
            )
    weight, bias = _plain_linear(head, name)
    if check_only:
        return None
    return hidden, weight, bias


def _lora(head, name, hidden, check_only):
    _check_no_hooks(head, name)
    base = head.get_base_layer()
    if head.disable_adapters or head.merged:
        if head.disable_adapters and head.merged and not check_only:
            head.unmerge()  # what lora.Linear.forward itself does before using the base layer
        return _resolve(base, f"{name}.base_layer", hidden, check_only)
    active = [a for a in head.active_adapters if a in head.lora_A]
    variants = getattr(head, "lora_variant", {})
    dora = getattr(head, "use_dora", {})
    for adapter in active:
        if adapter in variants or dora.get(adapter, False):
            kind = type(variants[adapter]).__name__ if adapter in variants else "DoRA"
            raise UnsupportedModelError(
                f"{name} carries the LoRA variant {kind} for adapter {adapter!r}; only vanilla "
                f"LoRA on the head is folded into the fused loss. {_ESCAPE}"
            )
    out = _resolve(base, f"{name}.base_layer", hidden, check_only)
    if check_only or not active:
        return out
    hidden, weight, bias = out
    hs, ws = [hidden], [weight]
    for adapter in active:
        lora_a, lora_b = head.lora_A[adapter], head.lora_B[adapter]
        scale = head.scaling[adapter]
        x = hidden.to(lora_a.weight.dtype)
        low = lora_a(head.lora_dropout[adapter](x)) * scale  # [..., r]
        hs.append(low.to(hidden.dtype))
        ws.append(lora_b.weight.to(weight.dtype))
        if lora_b.bias is not None:  # lora_bias=True: scale * b_B joins the head bias
            extra = (lora_b.bias * scale).to(weight.dtype)
            bias = extra if bias is None else bias + extra
    return torch.cat(hs, dim=-1), torch.cat(ws, dim=1), bias

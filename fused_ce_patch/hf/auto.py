"""``AutoFusedCEForCausalLM``: ``AutoModelForCausalLM`` that returns an already patched model."""

from __future__ import annotations

import warnings

from transformers import AutoModelForCausalLM

from ..errors import UnsupportedModelError
from .patch import apply_fused_ce, make_options

_OPTIONS = {
    "fused_ce_backend": "backend",
    "fused_ce_logits_budget": "logits_budget",
    "fused_ce_return_logits": "return_logits",
}


def _pop_options(kwargs: dict) -> dict:
    return {new: kwargs.pop(old) for old, new in _OPTIONS.items() if old in kwargs}


def _validate(options: dict) -> None:
    make_options(options.get("backend", "auto"), options.get("logits_budget"),
                 options.get("return_logits", False))


def _patch_or_warn(model, options: dict):
    """``apply_fused_ce(model)``, or ``model`` unpatched with one warning when it cannot be."""
    try:
        return apply_fused_ce(model, **options)
    except UnsupportedModelError as exc:
        warnings.warn(
            f"AutoFusedCEForCausalLM: loaded {type(model).__name__} without the fused loss "
            f"(it trains with transformers' own loss): {exc}",
            UserWarning,
            stacklevel=3,
        )
        return model


class AutoFusedCEForCausalLM(AutoModelForCausalLM):
    """``AutoModelForCausalLM`` whose models come back patched by :func:`apply_fused_ce`.

    Takes exactly the arguments of ``AutoModelForCausalLM.from_pretrained`` / ``from_config``
    (``dtype``, ``device_map``, ``gguf_file``, ``attn_implementation``, ...) plus three
    options, removed before transformers sees them:

    - ``fused_ce_backend``: backend of the fused loss (default ``"auto"``);
    - ``fused_ce_logits_budget``: bytes of transient logits per chunk (default: backend's);
    - ``fused_ce_return_logits``: keep real logits everywhere (default False).

    The patch is per instance (the class of the returned model is the ordinary transformers
    class, e.g. ``LlamaForCausalLM``); :func:`revert_fused_ce` undoes it. A model that
    :func:`apply_fused_ce` cannot patch (an architecture not supported yet, a quantised head)
    comes back unpatched, with one ``UserWarning`` saying why, so code written against this
    class keeps working on new models (Liger's ``AutoLigerKernelForCausalLM`` convention);
    :func:`apply_fused_ce` itself raises on such a model.

    Example::

        model = AutoFusedCEForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M",
                                                       dtype=torch.bfloat16)

    Raises:
        ValueError, TypeError: a bad ``fused_ce_*`` option (checked before anything loads).

    Warns:
        UserWarning: the model could not be patched and is returned unpatched.
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        options = _pop_options(kwargs)
        _validate(options)  # before any weights load
        model = AutoModelForCausalLM.from_pretrained(
            pretrained_model_name_or_path, *model_args, **kwargs
        )
        return _patch_or_warn(model, options)

    @classmethod
    def from_config(cls, config, **kwargs):
        options = _pop_options(kwargs)
        _validate(options)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        return _patch_or_warn(model, options)

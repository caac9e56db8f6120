"""``AutoFusedCEForCausalLM``: ``AutoModelForCausalLM`` that returns an already patched model."""

from __future__ import annotations

from transformers import AutoModelForCausalLM

from ..errors import UnsupportedModelError
from .architectures import ARCHITECTURES
from .patch import apply_fused_ce

_OPTIONS = {
    "fused_ce_backend": "backend",
    "fused_ce_logits_budget": "logits_budget",
    "fused_ce_return_logits": "return_logits",
}


def _pop_options(kwargs: dict) -> dict:
    return {new: kwargs.pop(old) for old, new in _OPTIONS.items() if old in kwargs}


def _check_config(config):
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"AutoFusedCEForCausalLM does not support model_type {model_type!r}; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )


class AutoFusedCEForCausalLM(AutoModelForCausalLM):
    """``AutoModelForCausalLM`` whose models come back patched by :func:`apply_fused_ce`.

    Takes exactly the arguments of ``AutoModelForCausalLM.from_pretrained`` / ``from_config``
    (``dtype``, ``device_map``, ``gguf_file``, ``attn_implementation``, ...) plus three
    options, removed before transformers sees them:

    - ``fused_ce_backend``: backend of the fused loss (default ``"auto"``);
    - ``fused_ce_logits_budget``: bytes of transient logits per chunk (default: backend's);
    - ``fused_ce_return_logits``: keep real logits everywhere (default False).

    The patch is per instance (the class of the returned model is the ordinary transformers
    class, e.g. ``LlamaForCausalLM``); :func:`revert_fused_ce` undoes it.

    Example::

        model = AutoFusedCEForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M",
                                                       dtype=torch.bfloat16)

    Raises:
        UnsupportedModelError: the checkpoint's architecture is not supported (raised before
            weights load when ``from_config`` or a ``config=`` argument says so, else after).
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        options = _pop_options(kwargs)
        if kwargs.get("config") is not None and not isinstance(kwargs["config"], str):
            _check_config(kwargs["config"])
        model = AutoModelForCausalLM.from_pretrained(
            pretrained_model_name_or_path, *model_args, **kwargs
        )
        return apply_fused_ce(model, **options)

    @classmethod
    def from_config(cls, config, **kwargs):
        options = _pop_options(kwargs)
        _check_config(config)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        return apply_fused_ce(model, **options)

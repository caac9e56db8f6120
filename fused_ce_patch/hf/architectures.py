"""What differs between the supported causal LMs: one row per architecture, one shared forward.

The five supported ``XForCausalLM`` classes run the same head after their decoder
(``hidden -> slice by logits_to_keep -> lm_head -> [softcap] -> ForCausalLMLoss``); they differ
only in the facts listed in :class:`ArchSpec`. Source: the ``forward`` of each class in
``transformers/models/<type>/modeling_<type>.py`` (checked on transformers 5.17 and 5.24;
Qwen2 and Mistral are generated from Llama's template, Gemma2 and Gemma3 add the softcap block).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    """The per-architecture facts the shared forward needs.

    Attributes:
        model_type: ``config.model_type`` that selects this row.
        module: import path of the modeling module holding the class.
        class_name: the causal-LM class whose ``forward`` is patched.
        decoder_attr: attribute of the causal LM holding the decoder (``XModel``).
        softcap_attr: config attribute with the final-logit softcap ``c`` (logits become
            ``c * tanh(z / c)``), or None when the architecture has none.
        logit_scale_attr: config attribute with a constant multiplying the logits after
            ``lm_head`` (before any softcap), or None.
        head_params: ``forward`` parameters consumed by the head, never passed to the decoder.
    """

    model_type: str
    module: str
    class_name: str
    decoder_attr: str = "model"
    softcap_attr: str | None = None
    logit_scale_attr: str | None = None
    head_params: tuple[str, ...] = ("labels", "logits_to_keep")

    def model_class(self):
        """The transformers class of this row (imports its modeling module)."""
        return getattr(importlib.import_module(self.module), self.class_name)

    def softcap(self, config) -> float | None:
        if self.softcap_attr is None:
            return None
        value = getattr(config, self.softcap_attr, None)
        return None if value is None else float(value)

    def logit_scale(self, config) -> float | None:
        if self.logit_scale_attr is None:
            return None
        value = getattr(config, self.logit_scale_attr, None)
        return None if value is None or float(value) == 1.0 else float(value)


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        ArchSpec("llama", "transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
        ArchSpec("qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
        ArchSpec("mistral", "transformers.models.mistral.modeling_mistral", "MistralForCausalLM"),
        ArchSpec(
            "gemma2",
            "transformers.models.gemma2.modeling_gemma2",
            "Gemma2ForCausalLM",
            softcap_attr="final_logit_softcapping",
        ),
        # Text-only Gemma 3 (e.g. Gemma-3-270M/1B); the multimodal Gemma3ForConditionalGeneration
        # (model_type "gemma3") is a different class and is not supported.
        ArchSpec(
            "gemma3_text",
            "transformers.models.gemma3.modeling_gemma3",
            "Gemma3ForCausalLM",
            softcap_attr="final_logit_softcapping",
        ),
    )
}


def supported_model_types() -> list[str]:
    """``config.model_type`` values :func:`~fused_ce_patch.apply_fused_ce` accepts."""
    return list(ARCHITECTURES)

"""fused_ce_patch: the causal-LM training loss straight from the last hidden states and the
lm_head weight, without materialising the ``[tokens, vocab]`` logits.

Public names (docs/design.md §2). The Hugging Face integration is imported on first use, so
``import fused_ce_patch`` does not import transformers.
"""

from __future__ import annotations

from importlib import import_module

from .errors import BackendUnavailableError, LogitsNotMaterializedError, UnsupportedModelError
from .loss import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .token_stats import ForwardGradHint, TokenStats, fused_linear_token_stats

__version__ = "0.1.0"

_LAZY = {
    "apply_fused_ce": "fused_ce_patch.hf.patch",
    "revert_fused_ce": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_llama": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_qwen2": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_gemma2": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_gemma3": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_mistral": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_class": "fused_ce_patch.hf.patch",
    "AutoFusedCEForCausalLM": "fused_ce_patch.hf.auto",
    "FusedCETrainingArguments": "fused_ce_patch.hf.trainer",
    "FusedCECallback": "fused_ce_patch.hf.trainer",
    "fused_ce_config": "fused_ce_patch.hf.trainer",
    "vocab_parallel_linear_cross_entropy": "fused_ce_patch.vocab_parallel",
}

__all__ = [
    "fused_linear_cross_entropy",
    "FusedLinearCrossEntropyLoss",
    "fused_linear_token_stats",
    "TokenStats",
    "ForwardGradHint",
    "BackendUnavailableError",
    "LogitsNotMaterializedError",
    "UnsupportedModelError",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fused_ce_patch' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))

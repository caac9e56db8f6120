"""fused_ce_patch: the causal-LM training loss straight from the last hidden states and the
lm_head weight, without materialising the ``[tokens, vocab]`` logits.

Public names (docs/design.md §2). The Hugging Face integration is imported on first use, so
``import fused_ce_patch`` does not import transformers.
"""

from __future__ import annotations

from importlib import import_module

from .errors import BackendUnavailableError, LogitsNotMaterializedError, UnsupportedModelError
from .loss import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from . import ops  # noqa: F401 - registers the custom op the loss calls under torch.compile
from .distill import fused_linear_jsd
from .token_stats import ForwardGradHint, TokenStats, fused_linear_token_stats

try:  # the installed distribution's version (pyproject.toml is the one source)
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("fused_ce_patch")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

_LAZY = {
    "apply_fused_ce": "fused_ce_patch.hf.patch",
    "revert_fused_ce": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_llama": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_qwen2": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_gemma2": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_gemma3": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_mistral": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_class": "fused_ce_patch.hf.patch",
    "is_fused_ce_applied": "fused_ce_patch.hf.patch",
    "apply_fused_ce_to_loss_mapping": "fused_ce_patch.hf.loss_mapping",
    "AutoFusedCEForCausalLM": "fused_ce_patch.hf.auto",
    "FusedCETrainingArguments": "fused_ce_patch.hf.trainer",
    "FusedCECallback": "fused_ce_patch.hf.trainer",
    "fused_ce_config": "fused_ce_patch.hf.trainer",
    "vocab_parallel_linear_cross_entropy": "fused_ce_patch.vocab_parallel",
    "vocab_parallel_linear_token_stats": "fused_ce_patch.vocab_parallel_stats",
}

__all__ = [
    "fused_linear_cross_entropy",
    "FusedLinearCrossEntropyLoss",
    "fused_linear_token_stats",
    "fused_linear_jsd",
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

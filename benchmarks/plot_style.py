"""One display name and one colour per implementation, shared by every benchmark plot.

Keys are the ``impl`` values stored in the JSON results (old and new); a reader sees the same
name and colour for the same code in every figure. "PyTorch" always means stock PyTorch
(materialised logits); our own chunked CPU backend is named as ours, never "torch".
"""

from __future__ import annotations

OURS = "#1f5fa8"

#: impl key -> (display name, colour)
STYLE = {
    # fused_ce_patch
    "ours-chunked": ("fused_ce_patch (triton, default budget)", OURS),
    "ours-256mib": ("fused_ce_patch (triton, 256 MiB memory-first)", "#6a9fd8"),
    "ours-zero": ("fused_ce_patch (triton, zero logits)", "#0b2f5c"),
    "torch": ("fused_ce_patch (chunked torch backend)", "#3d8ed6"),  # the CPU benchmark
    # stock PyTorch
    "torch-naive": ("PyTorch (materialised logits)", "#8c8c8c"),
    "naive": ("PyTorch (materialised logits)", "#8c8c8c"),  # the CPU benchmark's name
    "torch-compile": ("PyTorch + torch.compile", "#4d4d4d"),
    "torch-lce": ("PyTorch F.linear_cross_entropy (chunked)", "#ff7f0e"),
    "torch-lce-1024": ("PyTorch F.linear_cross_entropy (1024-row chunks)", "#ffbb78"),
    "cublas-3gemm": ("3 cuBLAS GEMMs (lower bound)", "#c7c7c7"),
    # peers
    "liger": ("Liger Kernel FLCE", "#d62728"),
    "cce": ("Cut Cross-Entropy", "#2ca02c"),
    "cce-exact": ("Cut Cross-Entropy (exact)", "#98df8a"),
    "cce-compile": ("Cut Cross-Entropy (torch_compile)", "#17becf"),
    "trl-head": ("TRL fused LM head (log-probs)", "#9467bd"),
    # distillation (benchmarks/gpu_jsd.py)
    "ours": ("fused_ce_patch fused_linear_jsd (triton)", OURS),
    "ours-entropy": ("fused_ce_patch fused_linear_jsd (+ entropy)", "#6a9fd8"),
    "ours-torch": ("fused_ce_patch fused_linear_jsd (torch row ops)", "#3d8ed6"),
    "trl-chunked": ("TRL ChunkedDivergenceFunction", "#9467bd"),
    "trl-gkd": ("TRL generalized_jsd_loss (materialised)", "#8c8c8c"),
}


def name(impl: str) -> str:
    """The display name of ``impl`` (the key itself when it has no entry yet)."""
    return STYLE.get(impl, (impl, None))[0]


def colour(impl: str) -> str | None:
    """The colour of ``impl`` (None: matplotlib's next colour, for an unlisted one)."""
    return STYLE.get(impl, (impl, None))[1]


def wants_log_axis(values, ratio: float = 10.0) -> bool:
    """True when the largest positive value is more than ``ratio`` times the smallest, so
    that on a linear axis one bar would dwarf the rest."""
    positive = [v for v in values if v == v and v > 0]
    return len(positive) > 1 and max(positive) > ratio * min(positive)

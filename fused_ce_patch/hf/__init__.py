"""Hugging Face transformers integration of the fused linear-cross-entropy.

Modules:
    architectures: the per-architecture table (softcap, logit scale, decoder attribute).
    forward: the one patched causal-LM forward shared by every architecture.
    head: the lm_head as ``(hidden, weight, bias)``, PEFT wrappers and LoRA included.
    sentinel: the guarded placeholder returned as ``outputs.logits`` on the fused path.
    loss_mapping: the chunked logits loss a patched model uses for materialised logits.
    patch: ``apply_fused_ce`` / ``revert_fused_ce`` and ``apply_fused_ce_to_<arch>``.
    auto: ``AutoFusedCEForCausalLM``.
    trainer: ``FusedCETrainingArguments`` and ``FusedCECallback`` (and TRL notes).

Importing this package imports nothing from transformers; the submodules do.
"""

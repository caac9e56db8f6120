"""``apply_fused_ce`` says at INFO what it patched and with which backend (as Liger users expect)."""

from __future__ import annotations

import logging

from fused_ce_patch import apply_fused_ce, revert_fused_ce

from hf_helpers import build_model


def test_apply_logs_class_model_type_and_backend(caplog):
    model = build_model("llama")
    with caplog.at_level(logging.INFO, logger="fused_ce_patch"):
        apply_fused_ce(model, backend="torch", logits_budget=4096)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(messages) == 1, messages
    assert "LlamaForCausalLM" in messages[0] and "'llama'" in messages[0]
    assert "backend 'torch'" in messages[0] and "4096" in messages[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fused_ce_patch"):
        apply_fused_ce(model)  # re-applying only changes the options, and says so
    assert "already patched" in caplog.records[0].getMessage()
    assert "backend 'auto'" in caplog.records[0].getMessage()
    revert_fused_ce(model)


def test_apply_is_silent_at_the_default_warning_level(caplog):
    model = build_model("qwen2")
    with caplog.at_level(logging.WARNING):
        apply_fused_ce(model)
    assert not [r for r in caplog.records if r.name.startswith("fused_ce_patch")]
    revert_fused_ce(model)


def test_a_sweep_check_leaves_the_logging_levels_as_they_were():
    # fused_ce_patch.hf.sweep.check_type quiets the patch logger for its own patches only: the
    # INFO record of a later apply_fused_ce must still reach the user (xdist ran this file
    # after test_sweep.py in one worker, and the first test above saw no record)
    from fused_ce_patch.hf import sweep

    patch_logger = logging.getLogger("fused_ce_patch.hf.patch")
    before = patch_logger.level
    row = sweep.check_type("llama")
    assert row["status"] == "pass", row
    assert patch_logger.level == before

"""Runs after tests/hf/test_liger.py (file order): Liger's process-wide patches were undone.

A leaked ``apply_rotary_pos_emb`` would make every later Llama / Gemma-3 test run Liger's RoPE
in the Triton interpreter (correct, but minutes slower) instead of transformers' own.
"""

import os

import pytest


def test_no_liger_function_left_in_transformers():
    pytest.importorskip("liger_kernel")
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama

    for module in (modeling_llama, modeling_gemma3):
        leaked = {name: getattr(value, "__module__", "") for name, value in vars(module).items()
                  if getattr(value, "__module__", "").startswith("liger_kernel")}
        assert not leaked, f"{module.__name__} still holds Liger's {leaked}"
    assert os.environ.get("TRITON_INTERPRET") in (None, "0", ""), "TRITON_INTERPRET left set"

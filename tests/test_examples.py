"""Every script in examples/ runs, as a user would run it, on real SmolLM2 with small settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.slow


def run_example(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_every_example_is_tested():
    tested = {"trainer_flag.py", "peft_lora.py", "auto_model.py", "plain_pytorch_loop.py",
              "trl_sft.py", "liger_combo.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_trainer_flag():
    out = run_example("trainer_flag.py", "--steps", "2", "--seq-len", "32")
    assert "training loss over 2 steps" in out
    assert "NotMaterializedLogits" in out


def test_peft_lora():
    out = run_example("peft_lora.py", "--steps", "2", "--seq-len", "32")
    assert "LoRA B matrices updated: 60 of 60" in out


def test_auto_model():
    out = run_example("auto_model.py", "--seq-len", "32")
    assert "generate() identical to the stock model" in out
    assert "logits were not materialised" in out


def test_plain_pytorch_loop():
    out = run_example("plain_pytorch_loop.py", "--steps", "2", "--seq-len", "32")
    assert "step 2/2" in out


def test_trl_sft():
    pytest.importorskip("trl")  # run by .ci/trl_matrix.sh, which installs TRL
    out = run_example("trl_sft.py", "--compare", "--seq-len", "32")
    assert "stock TRL (kernel calls 0)" in out


def test_liger_combo():
    pytest.importorskip("liger_kernel", reason="liger-kernel not installed (the test extra has it)")
    out = run_example("liger_combo.py", "--steps", "1", "--seq-len", "16")
    assert "step 1/1" in out and "relative difference" in out
    assert "fused_linear_cross_entropy=False" in out  # the pitfall's error, printed

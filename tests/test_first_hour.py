"""What a new user meets first (issue 23 §6): a missing optional package, or a machine without
Debian's licence texts, ends in one line that says what to do, never a traceback.

Each script runs in a fresh interpreter with the optional package blocked from import
(``sys.modules[name] = None``, which makes ``import name`` raise ``ImportError``), so the test
does not depend on what this environment has installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fused_ce_patch import cli
from fused_ce_patch.demo import data

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_blocked(blocked: tuple[str, ...], script: Path, *args: str):
    """Run ``script`` as ``__main__`` with the modules ``blocked`` unimportable."""
    code = (
        "import runpy, sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        f"sys.argv = [{str(script)!r}, *{list(args)!r}]\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FUSED_CE_", "TRITON_"))}
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)


@pytest.mark.parametrize(
    "script, blocked, install",
    [
        ("liger_combo.py", ("liger_kernel",), "pip install 'liger-kernel"),
        ("peft_lora.py", ("peft",), "pip install 'fused_ce_patch[peft]'"),
        ("trl_sft.py", ("trl",), "pip install trl"),
    ],
)
def test_example_without_its_optional_package_says_what_to_install(script, blocked, install):
    proc = run_blocked(blocked, EXAMPLES / script)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and install in lines[0], proc.stderr


@pytest.mark.parametrize("script", ["auto_model.py", "plain_pytorch_loop.py", "trainer_flag.py",
                                    "peft_lora.py"])
def test_every_example_takes_data_and_refuses_a_missing_file_in_one_line(script, tmp_path):
    missing = tmp_path / "missing.txt"
    proc = run_blocked((), EXAMPLES / script, "--data", str(missing))
    if proc.returncode == 2 and "needs PEFT" in proc.stderr:
        pytest.skip("peft is not installed")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"--data {str(missing)!r} does not exist" in proc.stderr


def test_every_example_documents_data():
    for script in EXAMPLES.glob("*.py"):
        text = script.read_text(encoding="utf-8")
        assert 'add_argument("--data"' in text and "[--data FILE]" in text, script.name


def test_model_path_without_gguf_is_one_line_naming_the_package(tmp_path, monkeypatch, capsys):
    weights = tmp_path / "tiny.gguf"
    weights.write_bytes(b"GGUF")  # never read: the check comes before any dequantising
    monkeypatch.setenv("FUSED_CE_PATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert cli.main(["model-path", str(weights)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install gguf" in err, err


def test_default_text_without_the_licence_folder_is_python_documentation(monkeypatch, tmp_path):
    monkeypatch.setattr(data, "DEFAULT_TEXT_DIR", tmp_path / "no-common-licenses")
    texts = data.read_texts()
    assert len(texts) == len(data.FALLBACK_MODULES)
    assert sum(map(len, texts)) > 50_000  # enough for the demo's 2 x 2048 tokens
    assert texts == data.read_texts()  # a fixed order: both demo runs see the same rows
    assert "argparse" in texts[0]
    assert "standard-library docstrings" in data.default_source()  # what the demo's header says


def test_default_text_is_the_licence_folder_where_it_exists(monkeypatch, tmp_path):
    (tmp_path / "MIT").write_text("Permission is hereby granted.")
    monkeypatch.setattr(data, "DEFAULT_TEXT_DIR", tmp_path)
    assert data.read_texts() == ["Permission is hereby granted."]
    assert data.default_source() == str(tmp_path)


def test_accelerate_lower_bound_is_what_trainer_needs():
    """transformers' Trainer refuses accelerate older than its ACCELERATE_MIN_VERSION."""
    from transformers.utils import import_utils

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'"accelerate>={import_utils.ACCELERATE_MIN_VERSION.removesuffix(".0")}"' in text


def test_demo_extra_brings_peft_for_the_peft_example():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(req.startswith("peft") for req in extras["demo"])

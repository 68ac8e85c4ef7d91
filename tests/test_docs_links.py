"""Every relative link in the README and under docs/ names a file that exists, and every
`#anchor` a heading of the page it points to, so pages can move without leaving a reader at a
dead link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
"""A Markdown link's target: `[text](target)` or `![alt](target)`."""
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def relative_targets(page: Path) -> list[str]:
    targets = [match.group(1) for match in LINK.finditer(page.read_text())]
    return [t for t in targets if "://" not in t and not t.startswith("mailto:")]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    made hyphens (code fences hold no headings)."""
    text = FENCE.sub("", page.read_text())
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in HEADING.findall(text)
    }


def dead_links(page: Path) -> list[str]:
    dead = []
    for target in relative_targets(page):
        path, _, anchor = target.partition("#")
        linked = page.parent / path if path else page
        if not linked.exists() or (anchor and anchor not in anchors(linked)):
            dead.append(target)
    return dead


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert dead_links(page) == [], f"{page.name} links to what is not there"


def test_links_are_found_where_they_are(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("![plot](docs/demo.png) [site](https://x.org) [up](#top) [p](policy.md#v)")
    assert relative_targets(page) == ["docs/demo.png", "#top", "policy.md#v"]


def test_a_missing_file_or_heading_is_a_dead_link(tmp_path: Path) -> None:
    (tmp_path / "policy.md").write_text("# The policy\n## Two actuators (`make e2e`)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "## Up here\n```sh\n# not a heading\n```\n[a](policy.md#two-actuators-make-e2e) "
        "[b](#up-here) [c](policy.md#the-policy) [d](gone.md) [e](#not-a-heading) "
        "[f](policy.md#units)"
    )
    assert dead_links(page) == ["gone.md", "#not-a-heading", "policy.md#units"]

"""Every relative link and #anchor in the README and the docs resolves (GitHub's heading slugs; no network)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    p for p in [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "results" / "README.md", *(ROOT / "docs").glob("*.md")] if p.exists()
)
_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+).*?\1")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page, with GitHub's -1, -2, ... suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    """The relative link targets of a page's prose (code spans and fenced blocks are not links)."""
    targets = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        for m in _LINK.finditer(_CODE_SPAN.sub("", line)):
            target = m.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked here
                targets.append(target)
    return targets


def test_slug_follows_github():
    assert slug("6b. Backbone-aware masks (pdmask's extension): `pdm_backbone_{full,topk}_{tv,kl}`") == (
        "6b-backbone-aware-masks-pdmasks-extension-pdm_backbone_fulltopk_tvkl"
    )
    assert slug("Results at scale (TinyGPT 3 December, SmolLM2 4–6 December 2026)") == (
        "results-at-scale-tinygpt-3-december-smollm2-46-december-2026"
    )


def test_the_pages_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/method.md", "docs/lab.md", "results/README.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(page: Path):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_a_broken_anchor_and_a_code_span_are_told_apart(tmp_path):
    page = tmp_path / "a.md"
    page.write_text(
        "# A title\n\n## A title\n\n[ok](#a-title-1) [bad](#missing) `[code](#nowhere)`\n\n```\n# not a heading\n[x](y.md)\n```\n"
    )
    assert anchors(page) == {"a-title", "a-title-1"}
    assert links(page) == ["#a-title-1", "#missing"]

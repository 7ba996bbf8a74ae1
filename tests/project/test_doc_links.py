"""The front door and the manual hold together (issue 43): every relative link in README.md,
docs/*.md, BENCHMARKS.md and scripts/README.md leads to a file of this repository that exists and,
where it names an #anchor, to a heading of that page (GitHub's anchor rule); every `scripts/...` and
`docs/....md` path these pages name exists; scripts/README.md gives every script one line; README stays
a front door (at most 300 lines) whose two set-up commands are the ones CI runs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "scripts" / "README.md",
                *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^()\s]+)\)")
FENCE = re.compile(r"^ *(```|~~~)")


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code spans (links there are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def anchors(text: str) -> set[str]:
    """GitHub's heading ids: the heading's text (links reduced to their text, code marks dropped),
    lower case, every character but letters, digits, '_', '-' and spaces dropped, spaces made '-';
    a repeated id gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6} +(.*?) *#* *$", line)
        if not m:
            continue
        words = LINK.sub(lambda k: k.group(1), m.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", words.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(2) for m in LINK.finditer(prose(page.read_text(encoding="utf-8")))]


def test_anchor_rule_is_githubs():
    """Checked on headings of the kinds our pages have, so a wrong rule cannot pass every link."""
    text = ("# Kimi K3 on MI325X / MI300X\n## What forbidding -8 costs: `optimal` vs `optimal-pm7` (issue 18 §4)\n"
            "## Results in brief ([BENCHMARKS.md](../BENCHMARKS.md) has it)\n## Notes\n## Notes\n"
            "```\n# not a heading\n```\n")
    assert anchors(text) == {"kimi-k3-on-mi325x--mi300x", "what-forbidding--8-costs-optimal-vs-optimal-pm7-issue-18-4",
                             "results-in-brief-benchmarksmd-has-it", "notes", "notes-1"}


def test_link_pattern_finds_links_and_skips_code():
    text = "see [a](docs/a.md) and [b `c`](b.md#x), not `[d](d.md)` nor ![img](i.png)\n```\n[e](e.md)\n```\n"
    assert LINK.findall(prose(text)) == [("a", "docs/a.md"), ("b ", "b.md#x")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    bad = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(ROOT) or not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_script_and_page_exists(page: Path):
    """`python scripts/benchmarks/bench_x.py` in a command, `docs/x.md` in a sentence: the file is there
    (a script moved without its mentions, or a page renamed, fails here)."""
    text = page.read_text(encoding="utf-8")
    named = set(re.findall(r"(?<![\w/.])((?:scripts|docs)/[\w./-]*\w)", text))
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, f"{page.relative_to(ROOT)} names {missing}"


def test_the_docs_index_links_every_page():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index)}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")} - {index.resolve()}
    assert not pages - linked, sorted(p.name for p in pages - linked)


def test_scripts_readme_gives_each_script_one_line():
    listing = ROOT / "scripts" / "README.md"
    linked = sorted(t for t in links(listing) if t.startswith(("benchmarks/", "tools/")))
    files = sorted(str(p.relative_to(listing.parent)) for p in listing.parent.glob("*/*") if p.is_file()
                   and "__pycache__" not in p.parts)
    assert linked == files
    assert [p.name for p in listing.parent.iterdir() if p.is_file()] == ["README.md"]  # none left at the top


def test_readme_is_a_front_door_with_the_two_setup_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    blocks = re.findall(r"^```\n(.*?)\n```$", readme, re.M | re.S)
    assert 'pip install torch==2.13.0 -e ".[test]" && k3convert demo' in blocks
    assert "python -m pytest -q" in blocks
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "python -m pytest -q" in ci          # CI runs the README's test command, as written

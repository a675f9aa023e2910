"""The README and docs/ hold together: the README fits on a few screens, every relative link (and heading anchor) it or
a docs page makes points at something that exists, every docs page is reachable from the README's "Where to read on",
and every `hlat <subcommand>` a ```bash block runs is one the CLI has. The blocks themselves are run by
tests/e2e/test_readme.py (the README's "Running flows") and tests/e2e/test_deployments.py (docs/deployments.md's
"Deployments and the Prefect UI")."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
# A link's target: [text](target), not an image's, not inside inline code.
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", flags=re.S | re.M)
# `hlat` where a shell runs a command: at a line's start or after ; & | ( (a path before it, e.g. .venv/bin/hlat,
# and VAR=value assignments allowed), followed by its first word.
HLAT_COMMAND = re.compile(r"(?:^|[;&|(])\s*(?:\w+=\S*\s+)*(?:nohup\s+)?(?:\S*/)?hlat\s+([a-z][a-z0-9-]*)", flags=re.M)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown text's headings (outside code fences), with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    found = set()
    for match in re.finditer(r"^#{1,6} (.+)$", FENCE.sub("", text), flags=re.M):
        base = anchor(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def relative_links(text: str) -> list[str]:
    """The links of a markdown text that point inside the repository (no scheme), outside code fences and spans."""
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(doc: Path) -> list[str]:
    """The relative links of `doc` whose file, or heading anchor in that file, does not exist."""
    broken = []
    for target in relative_links(doc.read_text()):
        path, _, fragment = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or (fragment and fragment not in anchors(dest.read_text())):
            broken.append(target)
    return broken


def subcommands() -> set[str]:
    from hlat.cli import build_parser

    actions = build_parser()._actions
    return set(next(a for a in actions if isinstance(a, argparse._SubParsersAction)).choices)


def hlat_commands(text: str) -> list[str]:
    """The first word after each `hlat` a ```bash block of `text` runs (comments left out)."""
    words = []
    for block in BASH_BLOCK.findall(text):
        code = "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in block.splitlines())
        words += HLAT_COMMAND.findall(code)
    return words


def test_the_readme_fits_on_a_few_screens() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to a page in docs/"


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.name)
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == [], f"{doc.relative_to(ROOT)}: links to nothing"


def test_every_docs_page_is_linked_from_where_to_read_on() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Where to read on\n", 1)[1].split("\n## ", 1)[0]
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(section)}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), "docs pages the README's 'Where to read on' does not link"


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.name)
def test_every_hlat_command_in_a_bash_block_exists(doc: Path) -> None:
    unknown = sorted(set(hlat_commands(doc.read_text())) - subcommands())
    assert unknown == [], f"{doc.relative_to(ROOT)} runs hlat subcommands the CLI does not have"


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """Each check fails on a broken example: a missing file, a missing anchor, an unknown subcommand."""
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A stop inside the grace (`SIGTERM`)\n")
    page.write_text(
        "[ok](other.md#a-stop-inside-the-grace-sigterm) [gone](missing.md) [no anchor](other.md#nowhere) "
        "[self](#title) [web](https://example.com) `[code](nowhere.md)`\n\n# Title\n"
    )
    assert broken_links(page) == ["missing.md", "other.md#nowhere"]
    block = "```bash\n.venv/bin/hlat pretrain --preset tiny && hlat trian x  # hlat nothing\nFOO=1 hlat plan\n```\n"
    assert hlat_commands(block) == ["pretrain", "trian", "plan"]
    assert "trian" not in subcommands()
    assert hlat_commands("```bash\nprefect deployment run hlat/pretrain-tiny --stack hlat\n```\n") == []

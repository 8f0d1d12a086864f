"""README.md stays a newcomer's page, every relative link in it and in docs/ leads somewhere (a
file, and a heading there when it names one), and mkdocs.yml's nav lists pages that exist."""

import importlib.util
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 300

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


def prose(text: str) -> str:
    """The text outside code blocks and code spans, where links are links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    return LINK.findall(prose(text))


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, each space a hyphen."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """Python-Markdown's toc slugify (MkDocs' default), which runs of spaces and hyphens share."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore")
    text = re.sub(r"[^\w\s-]", "", text.decode("ascii")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """Anchors both GitHub and MkDocs give a page's headings, so a link works on either."""
    headings = HEADING.findall(FENCE.sub("", page.read_text()))
    return {github_slug(h) for h in headings} & {mkdocs_slug(h) for h in headings}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return broken


def nav_pages(nav: list) -> list[str]:
    out = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference to docs/"


def test_readme_keeps_the_two_commands_verbatim() -> None:
    """CI calls the second; a newcomer copies both."""
    readme = (ROOT / "README.md").read_text()
    assert "./scripts/setup && .venv/bin/python -m pytest -q\n" in readme
    assert './scripts/setup && .venv/bin/smcspec generate "' in readme


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_lead_somewhere(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_sees_a_broken_link_and_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## Against llama.cpp\n\ntext\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#against-llamacpp) [ok](#here) `[code](nowhere.md)`\n\n## Here\n\n"
        "[gone](nowhere.md) [no heading](a.md#missing) [ok](https://example.com)\n"
        "```\n[in a fence](fenced.md)\n```\n"
    )
    assert [b.split(":")[0] for b in broken_links(page)] == ["nowhere.md", "a.md#missing"]


def test_slugs_follow_github_and_mkdocs() -> None:
    assert (
        github_slug("Against llama.cpp") == mkdocs_slug("Against llama.cpp") == "against-llamacpp"
    )
    assert github_slug("Measured: not yet") == "measured-not-yet"
    # where the two disagree, neither anchor is offered, so a link to it fails
    assert github_slug("a - b") == "a---b" != mkdocs_slug("a - b") == "a-b"


def test_every_nav_page_exists_and_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    assert [p for p in listed if not (DOCS / p).is_file()] == []
    assert sorted(p.name for p in DOCS.glob("*.md")) == sorted(listed)


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs not installed")
def test_mkdocs_builds_strict(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr

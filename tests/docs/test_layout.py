"""docs/development.md's layout names every module of the package, so a contributor who reads it
knows where each file's job is described, and names no module that is gone.

An entry of the layout is a line that starts with a path under smcspec/ (two spaces in) and the
lines indented below it. A module is named by its path ("models/llama.py"), by its file name on
a line whose entry heads with its folder ("decoding/autoregressive.py, speculative.py"), or, in
an entry for a folder or a module of its folder, by its name as a word ("bench/ ... law ...",
"models/llama.py ... (llama_config)"; "gpu.pairs" in a sub-folder)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "smcspec"
ENTRY = re.compile(r"^  (\S+)")


def layout_entries(page: str) -> list[tuple[str, str]]:
    """(head, text) of each entry of the page's Layout block: head the first path on its line,
    text its lines joined."""
    block = page.split("## Layout", 1)[1].split("```")[1]
    entries: list[tuple[str, str]] = []
    for line in block.splitlines():
        head = ENTRY.match(line)
        if head and not line.startswith("   "):
            entries.append((head.group(1).rstrip(","), line))
        elif entries and line.startswith("   "):
            entries[-1] = (entries[-1][0], entries[-1][1] + "\n" + line)
    return entries


def folder(path: str) -> str:
    return path.rsplit("/", 1)[0] + "/" if "/" in path else ""


def named(module: str, entries: list[tuple[str, str]]) -> bool:
    """Whether the entries name `module` (a path below smcspec/, as "bench/gpu/pairs.py")."""
    name = module.rsplit("/", 1)[-1].removesuffix(".py")
    for head, text in entries:
        if head == module or ("/" in module and module in re.findall(r"[\w/]+\.py", text)):
            return True
        # the head's own folder, or a folder entry above the module
        top = head if head.endswith("/") else folder(head)
        if not module.startswith(top) or (not top and "/" in module):
            continue
        rest = module[len(top) :].removesuffix(".py").replace("/", ".")
        on_line = re.search(rf"(?<![\w/.]){re.escape(name)}\.py\b", text) and folder(module) == top
        if on_line or re.search(rf"(?<![\w/]){re.escape(rest)}\b", text):
            return True
    return False


def modules() -> list[str]:
    return sorted(
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
    )


def test_the_layout_names_every_module():
    entries = layout_entries((ROOT / "docs" / "development.md").read_text())
    missing = [m for m in modules() if not named(m, entries)]
    assert not missing, f"docs/development.md's layout does not name {missing}"


def test_the_layout_names_no_module_that_is_gone():
    entries = layout_entries((ROOT / "docs" / "development.md").read_text())
    paths = {head for head, _ in entries if head.endswith(".py")}
    gone = sorted(p for p in paths if not (PACKAGE / p).exists())
    assert not gone, f"docs/development.md's layout names modules that are gone: {gone}"


def test_the_check_fails_on_a_page_without_a_module():
    """The checks can fail: an entry dropped, a name dropped from a folder entry, and an entry
    for a module that is not there, each caught."""
    page = (
        "## Layout\n```\n"
        "  models/llama.py      the forward; its config (llama_config)\n"
        "  bench/               speed, law,\n"
        "                       gpu (gpu.pairs)\n"
        "  decoding/ar.py, sd.py   two methods\n"
        "```\n"
    )
    entries = layout_entries(page)
    assert named("models/llama.py", entries) and named("models/llama_config.py", entries)
    assert named("bench/law.py", entries) and named("bench/gpu/pairs.py", entries)
    assert named("decoding/sd.py", entries)
    assert not named("models/rope.py", entries)
    assert not named("bench/tasks.py", entries)
    assert not named("bench/gpu/report.py", entries)
    assert not named("server/sd.py", entries)  # sd.py is named in decoding/'s entry only
    assert not named("sd.py", entries)

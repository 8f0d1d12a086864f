"""Sizes in smcspec: no function over 60 lines, no module over 500, with no exemptions, so that
a function reads at once and a module holds one noun.

A function runs from its `def` line to its last line (`end_lineno - lineno + 1` of its ast node:
the docstring counts, decorators do not); methods and nested functions count on their own and
inside the function holding them. A module is its physical lines. The checker also runs on
made-up sources one line either side of each limit, so a check that could never fail is caught
here too."""

from __future__ import annotations

import ast
from pathlib import Path

import smcspec

PACKAGE = Path(smcspec.__file__).parent
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500


def oversized(source: str, name: str) -> list[str]:
    """What module `name` (its text `source`) breaks, one line each."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}: module of {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(
                    f"{name}:{node.lineno}: {node.name} has {length} lines "
                    f"(at most {MAX_FUNCTION_LINES})"
                )
    return found


def test_no_function_or_module_is_too_long():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += oversized(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "\n".join(found)


def _function(lines: int, head: str = "def f():", indent: str = "") -> str:
    """A function of `lines` lines from its `def`."""
    body = f"{indent}    x = 1\n" * (lines - 1)
    return f"{indent}{head}\n{body}"


def test_the_check_catches_a_function_or_a_module_one_line_too_long():
    assert oversized(_function(60), "m") == []
    assert oversized(_function(61), "m") == ["m:1: f has 61 lines (at most 60)"]
    # a decorator is not the function's; a method and an async def are found inside a class
    assert oversized("@staticmethod\n" + _function(60), "m") == []
    method = "class C:\n" + _function(61, "async def g(self):", indent="    ")
    assert oversized(method, "m") == ["m:2: g has 61 lines (at most 60)"]
    assert oversized("x = 1\n" * 500, "m") == []
    assert oversized("x = 1\n" * 501, "m") == ["m: module of 501 lines (at most 500)"]

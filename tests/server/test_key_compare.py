"""The API key is compared in constant time (server/guard.py), read from its source.

A plain `==` between the given token and the key passes every HTTP test: the leak is in the
time a comparison takes, which no test can measure reliably. So guard.py is parsed, and what
flows from the configured key (`.api_key`) and from the client's `authorization` header is
followed through assignments, `self` attributes and calls into the module's own functions.
Then:

- no comparison (`==`, `!=`, `in`, `<`, ...; `is None` aside) and no prefix or search method
  touches anything derived from the configured key: those stop at the first differing byte;
- the key check is one `hmac.compare_digest` of the key against the given token, both SHA-256
  digests, so that equal lengths hide the key's length too.

Each rule is also run on small made-up guards that break it, so a rule that could never fail
is caught here too (as tests/test_layering.py does)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from smcspec.server import guard

KEY, GIVEN, DIGEST = "the configured key", "the given token", "a SHA-256 digest"
LEAKY_METHODS = {"startswith", "endswith", "find", "index", "count", "__eq__", "__ne__"}
Scope = tuple[str, ...]  # the classes and functions around a node, outermost first
Name = tuple[Scope, str]  # a variable: where it lives and its name


class Flow:
    """Which labels (KEY, GIVEN, DIGEST) each variable of a module can hold, found by running
    over the module until nothing changes (flow-insensitive: a variable holds everything ever
    assigned to it). Variables are per function; `self.x` is one variable per module; a call
    into one of the module's functions binds its parameters and returns what it returns."""

    def __init__(self, tree: ast.Module) -> None:
        self.labels: dict[Name, set[str]] = {}
        self.functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        self.scopes = dict(_scoped(tree))
        while self._pass():
            pass

    def of(self, node: ast.expr, scope: Scope, calling: frozenset[str] = frozenset()) -> set[str]:
        """The labels `node` can carry; DIGEST only on a digest itself, not on what is made of
        one."""
        if isinstance(node, ast.Attribute) and node.attr == "api_key":
            return {KEY}
        if isinstance(node, ast.Attribute) and _is_self(node.value):
            return set(self.labels.get((("self",), node.attr), set()))
        if isinstance(node, ast.Name):
            return self._lookup(scope, node.id)
        if isinstance(node, ast.IfExp):  # either branch is the value itself
            return self.of(node.body, scope, calling) | self.of(node.orelse, scope, calling)
        if isinstance(node, ast.Call) and _is_sha256_digest(node):
            inner = node.func.value  # type: ignore[attr-defined]
            return {DIGEST} | set().union(*(self.of(a, scope) for a in inner.args)) - {DIGEST}
        if isinstance(node, ast.Call) and any(_is_authorization(a) for a in node.args):
            return {GIVEN}
        found = set()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            called = self.functions.get(node.func.id)
            if called is not None and called.name not in calling:
                returns = [r.value for r in ast.walk(called) if isinstance(r, ast.Return)]
                inside, deeper = (called.name,), calling | {called.name}
                found = set().union(*(self.of(r, inside, deeper) for r in returns if r))
        children = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr)]
        return found | set().union(*(self.of(c, scope, calling) for c in children)) - {DIGEST}

    def _lookup(self, scope: Scope, name: str) -> set[str]:
        for depth in range(len(scope), -1, -1):  # an inner function reads its outer ones' names
            if (scope[:depth], name) in self.labels:
                return set(self.labels[(scope[:depth], name)])
        return set()

    def _pass(self) -> bool:
        changed = False
        for node, scope in self.scopes.items():
            for targets, value in self._bindings(node, scope):
                found = self.of(value, scope)
                for name in targets:
                    have = self.labels.setdefault(name, set())
                    changed |= not found <= have
                    have |= found
        return changed

    def _bindings(self, node: ast.AST, scope: Scope) -> Iterator[tuple[list[Name], ast.expr]]:
        """(the variables bound, the expression they get) for each binding `node` makes."""
        if isinstance(node, ast.Assign):
            yield [n for t in node.targets for n in _names(t, scope)], node.value
        elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.NamedExpr) and node.value:
            yield list(_names(node.target, scope)), node.value
        elif isinstance(node, ast.For | ast.comprehension):
            yield list(_names(node.target, scope)), node.iter
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            called = self.functions.get(node.func.id)
            if called is not None:
                params = [a.arg for a in called.args.args]
                for param, arg in zip(params, node.args, strict=False):
                    yield [((called.name,), param)], arg
                for keyword in node.keywords:
                    if keyword.arg in params:
                        yield [((called.name,), keyword.arg)], keyword.value


def _scoped(tree: ast.Module) -> Iterator[tuple[ast.AST, Scope]]:
    """Each node with the names of the classes and functions around it."""

    def walk(node: ast.AST, scope: Scope) -> Iterator[tuple[ast.AST, Scope]]:
        for child in ast.iter_child_nodes(node):
            named = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            inner = (*scope, child.name) if named else scope  # type: ignore[attr-defined]
            yield child, inner
            yield from walk(child, inner)

    return walk(tree, ())


def _names(target: ast.expr, scope: Scope) -> Iterator[Name]:
    if isinstance(target, ast.Name):
        yield scope, target.id
    elif isinstance(target, ast.Attribute) and _is_self(target.value):
        yield ("self",), target.attr
    elif isinstance(target, ast.Tuple | ast.List | ast.Starred):
        for element in getattr(target, "elts", [getattr(target, "value", None)]):
            yield from _names(element, scope)


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _is_sha256_digest(call: ast.Call) -> bool:
    f = call.func
    return (
        isinstance(f, ast.Attribute)
        and f.attr == "digest"
        and isinstance(f.value, ast.Call)
        and ast.unparse(f.value.func) == "hashlib.sha256"
    )


def _is_authorization(node: ast.expr) -> bool:
    if not isinstance(node, ast.Constant) or not isinstance(node.value, str | bytes):
        return False
    text = node.value.decode() if isinstance(node.value, bytes) else node.value
    return text.lower() == "authorization"


def key_problems(source: str) -> list[str]:
    """Every way `source` (a guard module) breaks the two rules in this file's docstring."""
    flow = Flow(ast.parse(source))
    problems, compared = [], []
    for node, scope in flow.scopes.items():
        if isinstance(node, ast.Compare):
            if all(isinstance(op, ast.Is | ast.IsNot) for op in node.ops):
                continue
            if any(KEY in flow.of(o, scope) for o in [node.left, *node.comparators]):
                problems.append(f"line {node.lineno}: `{ast.unparse(node)}` compares the key")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if ast.unparse(node.func) == "hmac.compare_digest":
                compared.append([flow.of(a, scope) for a in node.args])
            elif node.func.attr in LEAKY_METHODS and any(
                KEY in flow.of(p, scope) for p in [node.func.value, *node.args]
            ):
                problems.append(f"line {node.lineno}: `{ast.unparse(node)}` scans the key")
    wanted = ({KEY, DIGEST}, {GIVEN, DIGEST})
    if not any(
        len(args) == 2 and all(w <= a for w, a in zip(wanted, order, strict=True))
        for args in compared
        for order in (args, args[::-1])
    ):
        problems.append(
            "no hmac.compare_digest of the key's digest with the given token's digest "
            f"(its arguments carry: {compared or 'no call'})"
        )
    return problems


GUARD = Path(guard.__file__)


def test_guard_compares_the_key_in_constant_time_only():
    assert key_problems(GUARD.read_text()) == []


GOOD = """
import hashlib, hmac

class Guard:
    def __init__(self, server):
        key = server.defaults.api_key
        self.key_digest = hashlib.sha256(key.encode()).digest()

    def refused(self, scope):
        return check(scope, self.key_digest)

def check(scope, key_digest):
    if key_digest is None:
        return False
    given = header(scope, b"authorization")
    scheme, _, token = given.partition(b" ")
    digest = hashlib.sha256(token).digest()
    return not (hmac.compare_digest(digest, key_digest) and scheme.lower() == b"bearer")

def header(scope, name):
    for key, value in scope["headers"]:
        if key == name:
            return value
"""

# (a line of GOOD, what replaces it, the problem found)
BROKEN = {
    "== on the digests": (
        "hmac.compare_digest(digest, key_digest)",
        "digest == key_digest",
        "`digest == key_digest` compares the key",
    ),
    "!= on the raw key, beside compare_digest": (
        "hmac.compare_digest(digest, key_digest)",
        "hmac.compare_digest(digest, key_digest) and token != configured(scope)",
        "`token != configured(scope)` compares the key",
    ),
    "the key in a set": (
        "if key_digest is None:",
        "if token_of(scope) in {key_digest}:",
        "compares the key",
    ),
    "compare_digest on the raw tokens (leaks the length)": (
        "digest = hashlib.sha256(token).digest()",
        "digest = token",
        "no hmac.compare_digest of the key's digest",
    ),
    "compare_digest against a constant": (
        "hmac.compare_digest(digest, key_digest)",
        "hmac.compare_digest(digest, b'x' * 32)",
        "no hmac.compare_digest of the key's digest",
    ),
    "a prefix scan of the key": (
        "if key_digest is None:",
        "if key_digest is None or token_of(scope).startswith(key_digest):",
        "scans the key",
    ),
}
HELPERS = """
def configured(scope):
    return scope.api_key

def token_of(scope):
    return header(scope, b"authorization")
"""


def test_the_made_up_good_guard_passes():
    assert key_problems(GOOD + HELPERS) == []


@pytest.mark.parametrize("broken", BROKEN.values(), ids=BROKEN.keys())
def test_each_rule_rejects_a_made_up_guard_that_breaks_it(broken):
    line, replacement, problem = broken
    assert line in GOOD
    problems = key_problems(GOOD.replace(line, replacement) + HELPERS)
    assert any(problem in p for p in problems), problems

"""The import graph of smcspec: no circle, and arrows only point down the layers (see
docs/development.md).

Every `import` in the package counts, those inside functions included: a lazy import still ties
two modules together. Each check is also run on a small made-up graph that breaks it, so that a
check that could never fail is caught here too."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import smcspec

PACKAGE = Path(smcspec.__file__).parent

# Lowest first. A module may import its own layer's modules and any layer below.
LAYERS = (
    {"config", "sampling", "rewards"},
    {"kv"},
    {"models"},
    {"potentials", "grammars"},
    {"decoding"},
    {"engine"},
    {"smcspec"},
    {"bench", "server"},
    {"cli", "__main__"},
)
# Above the engine only the engine's public API is used (plus the settings and potentials a
# user passes in): the command lines, the server and the benchmarks never reach into the models,
# the KV cache or the decoders. `bench gpu` is the exception: it checks the model layer itself
# (the Triton kernel against its reference, CUDA graphs against eager, native against hf).
USER_FACING = {"smcspec", "bench", "server", "cli", "__main__"}
ENGINE_INTERNALS = {"models", "kv", "decoding"}
MODEL_LAYER_CHECKS = {
    "smcspec.bench.gpu.runner",
    "smcspec.bench.gpu.checks",
    "smcspec.bench.gpu.pairs",
}


def module_name(path: Path) -> str:
    parts = ("smcspec", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the smcspec modules it imports (`from a import b` names the module a.b when
    b is one, else a itself)."""
    modules = {module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> str:
    """smcspec.engine.llm -> engine; the package's own __init__ -> smcspec."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "smcspec"


def rank(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if layer_of(module) in layer)


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of a module in a higher layer."""
    return sorted((a, b) for a, bs in graph.items() for b in bs if rank(b) > rank(a))


def reaching_in(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """User-facing modules that import the engine's internals."""
    return sorted(
        (a, b)
        for a, bs in graph.items()
        for b in bs
        if layer_of(a) in USER_FACING
        and layer_of(b) in ENGINE_INTERNALS
        and a not in MODEL_LAYER_CHECKS
    )


# A method's facts (its name, settings class, decoder, KV rows, lookahead, whether it takes
# potentials) are written once, in its row of the method table; elsewhere code reads the row.
# The benchmarks and their command line are exempt: a benchmark is an experiment on named
# methods (which settings each sweeps, how a report groups them).
METHOD_TABLE = "smcspec.decoding.methods"
METHOD_EXPERIMENTS = ("smcspec.bench", "smcspec.cli.bench")  # module name prefixes


def method_facts(source: str, methods: set[str], configs: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each per-method fact written in `source`: a comparison with a method's
    name, a config's type tested (isinstance / type(...) is), a Literal or a dict keyed by
    method names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            names = {
                c.value
                for side in (node.left, *node.comparators)
                for c in ast.walk(side)
                if isinstance(c, ast.Constant)
            }
            types = {getattr(side, "id", None) for side in node.comparators}
            if names & methods or (
                types & configs
                and any(isinstance(op, ast.Is | ast.IsNot | ast.Eq) for op in node.ops)
            ):
                found.append((node.lineno, "compares with a method"))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            if {getattr(n, "id", None) for n in ast.walk(node.args[1])} & configs:
                found.append((node.lineno, "tests a config's type"))
        elif isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal":
            if {c.value for c in ast.walk(node.slice) if isinstance(c, ast.Constant)} & methods:
                found.append((node.lineno, "a Literal of method names"))
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if len(keys & methods) > 1:
                found.append((node.lineno, "a dict keyed by method names"))
    return found


# Method names that are also everyday setting values elsewhere (dtype="auto", tool_choice
# "auto", device "auto"): a comparison with them is no method fact. Their config types still
# count.
COMMON_WORDS = {"auto"}


def _method_table() -> tuple[set[str], set[str]]:
    from smcspec.decoding import methods

    names = set(methods.TABLE) - COMMON_WORDS
    return names, {row.config.__name__ for row in methods.TABLE.values()}


def test_method_facts_live_only_in_the_method_table():
    names, configs = _method_table()
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    found = [
        (name, line, what)
        for name, path in sorted(modules.items())
        if name != METHOD_TABLE and not name.startswith(METHOD_EXPERIMENTS)
        for line, what in method_facts(path.read_text(), names, configs)
    ]
    assert found == []


def test_the_method_fact_check_rejects_facts_written_elsewhere():
    """What the table replaced: the CLI's `== "sd"`, the request's isinstance, the schema's
    Literal, `method_of`'s dict; a read of the row passes."""
    names, configs = _method_table()
    for source in (
        'if args.method == "sd" and potentials: pass',
        "rows = (1, 0) if isinstance(decoding, ARConfig) else (1, 1)",
        'method: Literal["ar", "sd", "smc"] | None = None',
        'names = {"ar": ARConfig, "sd": SDConfig}',
        "picked = type(decoding) is SMCConfig",
    ):
        assert method_facts(source, names, configs), source
    assert not method_facts("ok = method_row(args.method).potentials", names, configs)


def test_every_module_has_a_layer():
    unplaced = {layer_of(m) for m in import_graph()} - set().union(*LAYERS)
    assert not unplaced, f"add to LAYERS: {unplaced}"


def test_there_is_no_import_circle():
    assert circles(import_graph()) == []


def test_imports_only_point_down():
    assert upward(import_graph()) == []


def test_user_facing_code_goes_through_the_engine():
    assert reaching_in(import_graph()) == []


def _graph(edges: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    return graph


def test_the_checks_reject_graphs_that_break_them():
    """The import circle this test was written after (cli <-> bench.cli), a longer one, a model
    importing a decoder, and the CLI reaching into the KV cache."""
    assert circles(
        _graph([("smcspec.cli", "smcspec.cli.bench"), ("smcspec.cli.bench", "smcspec.cli")])
    )
    longer = [
        ("smcspec.engine.llm", "smcspec.decoding.smc"),
        ("smcspec.decoding.smc", "smcspec.models.llama"),
    ]
    assert circles(_graph([*longer, ("smcspec.models.llama", "smcspec.engine.llm")])) == [
        ["smcspec.decoding.smc", "smcspec.engine.llm", "smcspec.models.llama"]
    ]
    assert not circles(_graph(longer))
    assert upward(_graph([("smcspec.models.llama", "smcspec.decoding.smc")]))
    assert reaching_in(_graph([("smcspec.cli", "smcspec.kv.pages")]))
    assert not reaching_in(_graph([("smcspec.bench.gpu.pairs", "smcspec.models.llama")]))

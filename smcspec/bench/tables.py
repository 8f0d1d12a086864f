"""The benchmark tables quoted in README.md and docs/, rendered from the committed result files
under benchmarks/, so no figure in the prose is a hand copy.

A page marks each generated table with a pair of comments, and `render` rewrites what lies
between them:

    <!-- table: cpu/llama-cpp -->

    ...generated...

    <!-- /table -->

(the blank lines keep Python-Markdown from reading a marker as part of the table).

A table comes from a run's JSON lines where the run kept them (the same summaries `smcspec bench
report` prints) and from the Markdown `smcspec bench` wrote where it kept only that. Each block
starts with a caption naming its source file, machine and models.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smcspec.bench import report
from smcspec.bench.machine import ran_on
from smcspec.bench.results import header, measurements, provenance

# Markers stand on lines of their own, so prose may quote one in backticks.
MARKER = re.compile(
    r"^<!-- table: (?P<name>[\w./-]+) -->\n(?P<body>.*?)^<!-- /table -->\n", re.S | re.M
)
OPENING = re.compile(r"^<!-- table: ", re.M)


@dataclass(frozen=True)
class Column:
    head: str
    cell: Callable[[dict[str, Any]], str]


def grid(columns: list[Column], rows: list[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(c.head for c in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(c.cell(r) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def caption(path: Path, root: Path) -> str:
    """Where a table's numbers come from: the file, and the machine and models its header names
    (a Markdown-only run names them in its first line, unless that line is a title)."""
    rel = "benchmarks/" + path.relative_to(root).as_posix()
    if path.suffix == ".md":
        first = path.read_text().splitlines()[0]
        said = "" if first.startswith("#") else f": {first}"
        return f"*Source: `{rel}`{said}*\n\n"
    machine, models = source(path)
    return f"*Source: `{rel}`; {machine}; {models}.*\n\n"


def source(path: Path) -> tuple[str, str]:
    """The machine a JSON-lines file's header names (and any a resumed run moved to), and its
    models, from one read of the file."""
    hdr, ran = provenance(path)
    return ran_on(ran), report.models_line(hdr)


def markdown_table(path: Path, index: int = 0) -> str:
    """The index-th table of a Markdown file `smcspec bench` wrote, as it stands."""
    blocks = re.findall(r"(?:^\|.*\|\n)+", path.read_text(), re.M)
    if index >= len(blocks):
        raise ValueError(f"{path}: no table {index} (it has {len(blocks)})")
    return blocks[index]


def _f(key: str, digits: int = 2, suffix: str = "") -> Callable[[dict[str, Any]], str]:
    def cell(row: dict[str, Any]) -> str:
        value = row.get(key)
        return "-" if value is None else report._fmt(value, digits) + suffix

    return cell


# ---- the native-vs-transformers engine run (benchmarks/cpu/engine-int8/engine.jsonl)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 1 else f"{value:.3f}"


def engine_steps(root: Path, run: str) -> str:
    path = root / run / "engine.jsonl"
    records, plan = measurements(path), header(path)["plan"]
    backends = header(path)["backends"]
    steps = {r["backend"]: r["ms"] for r in records if r["key"].startswith("steps|")}
    rows = [{"name": name, **{b: steps[b].get(name) for b in backends}} for name in steps["native"]]
    resample = {r["backend"]: r["ms"] for r in records if r["key"].startswith("resample|")}
    tokens = plan["context"] + plan["resample_tokens"]
    rows.append({"name": f"resample {plan['resample_particles']} particles at {tokens} tokens"})
    rows[-1].update(resample)
    columns = [Column("forward pass (ms)", lambda r: r["name"])]
    columns += [Column(b, lambda r, b=b: _ms(r.get(b))) for b in backends]
    return caption(path, root) + grid(columns, rows)


def engine_kv(root: Path, run: str) -> str:
    """The KV memory one SMC run held in shared pages against one contiguous cache a particle."""
    path = root / run / "engine.jsonl"
    kv = next(r for r in measurements(path) if r["key"] == "kv|native")
    plan = header(path)["plan"]
    n, mib = plan["resample_particles"], 2**20
    return caption(path, root) + (
        f"KV memory of one SMC run on the native engine (N={n}, K=4, {plan['resample_tokens']} "
        f"new tokens, target + draft): peak {kv['paged_peak_bytes'] / mib:.1f} MiB in shared "
        f"pages against {kv['naive_bytes'] / mib:.1f} MiB for {n} contiguous caches "
        f"({100 * kv['saving']:.1f}% less); {kv['resamples']} resamples in {kv['rounds']} rounds "
        f"took {1e3 * kv['resample_seconds']:.1f} ms in all.\n"
    )


def engine_end_to_end(root: Path, run: str, backends: tuple[str, ...] = ()) -> str:
    """Mean tokens/s per method and backend, with and without the prefill; x is over ar in the
    same engine (the definitions of `smcspec bench engine`)."""
    path = root / run / "engine.jsonl"
    e2e = [r for r in measurements(path) if r["key"].startswith("e2e|")]
    backends = backends or tuple(header(path)["backends"])
    rows = []
    for label in dict.fromkeys(r["label"] for r in e2e):
        row: dict[str, Any] = {"label": label, "diagnostics": _engine_diagnostics(e2e, label)}
        for b in backends:
            for decode, key in ((False, b), (True, f"{b} decode")):
                row[key] = _engine_mean(e2e, b, label, decode)
                row[f"{key} x"] = row[key] / _engine_mean(e2e, b, "ar", decode)
        rows.append(row)
    columns = [Column("method", lambda r: r["label"])]
    for b in backends:
        for key in (b, f"{b} decode"):
            columns += [Column(f"{key} tok/s", _f(key)), Column(f"{key} x", _f(f"{key} x"))]
    columns.append(Column("diagnostics", lambda r: r["diagnostics"]))
    return caption(path, root) + grid(columns, rows)


def engine_by_weights(root: Path, runs: dict[str, str]) -> str:
    """One row per method, the native engine's mean tokens/s (with and without the prefill) in
    each of several `bench engine` runs, named by their weights; diagnostics of the first."""
    paths = {name: root / run / "engine.jsonl" for name, run in runs.items()}
    e2e = {
        name: [r for r in measurements(p) if r["key"].startswith("e2e|")]
        for name, p in paths.items()
    }
    first = next(iter(e2e.values()))
    rows = []
    for label in dict.fromkeys(r["label"] for r in first):
        row: dict[str, Any] = {"label": label, "diagnostics": _engine_diagnostics(first, label)}
        for name, records in e2e.items():
            row[name] = _engine_mean(records, "native", label, False)
            row[f"{name} decode"] = _engine_mean(records, "native", label, True)
        rows.append(row)
    columns = [Column("method", lambda r: r["label"])]
    for name in paths:
        columns += [
            Column(f"{name} tok/s", _f(name)),
            Column(f"{name} decode", _f(f"{name} decode")),
        ]
    columns.append(Column(f"diagnostics ({next(iter(runs))})", lambda r: r["diagnostics"]))
    return captions(list(paths.values()), root) + grid(columns, rows)


def _engine_mean(records: list[dict], backend: str, label: str, decode: bool) -> float:
    rs = [r for r in records if r["backend"] == backend and r["label"] == label]
    if decode:
        return statistics.mean(report.decode_rate(r) for r in rs)
    return statistics.mean(r["tokens_per_second"] for r in rs)


def _engine_diagnostics(records: list[dict], label: str) -> str:
    rs = [r for r in records if r["label"] == label and r["backend"] == records[0]["backend"]]
    if label.startswith("sd"):
        return f"acceptance {statistics.mean(r['acceptance_rate'] for r in rs):.2f}"
    if label.startswith("smc"):
        ess = statistics.mean(statistics.mean(r["ess"]) for r in rs)
        rate = sum(r["resamples"] for r in rs) / sum(r["rounds"] for r in rs)
        return f"mean ESS {ess:.2f}, resample rate {rate:.2f}"
    return ""


# ---- `smcspec bench speed` runs (speed.jsonl)


def speed(root: Path, run: str) -> str:
    path = root / run / "speed.jsonl"
    return caption(path, root) + report.speed_table(report.speed_summary(measurements(path)))


def best_fixed(root: Path, run: str) -> str:
    """Per cell of a speed run: the fastest fixed settings and auto's ratios to them."""
    path = root / run / "speed.jsonl"
    rows = report.speed_summary(measurements(path))
    return caption(path, root) + report.best_fixed_table(report.best_fixed(rows))


def against_llama_cpp(root: Path, run: str) -> str:
    """Ours and llama.cpp's, one row per contender, named for a reader who has not seen the
    bench's labels."""
    path = root / run / "speed.jsonl"
    rows = report.speed_summary(measurements(path))
    precision = header(path)["machine"]["precision"].split(",")[0]  # "int4, native backend"
    columns = [
        Column("method", lambda r: _peer_name(r, precision)),
        Column("tok/s (median)", _f("median_tps")),
        Column("min-max", lambda r: f"{r['min_tps']:.2f}-{r['max_tps']:.2f}"),
        Column("vs our ar", _f("vs_ar", suffix="x")),
        Column("decode tok/s", _f("median_decode_tps")),
        Column("draft acceptance", _acceptance_or_ess),
    ]
    return caption(path, root) + grid(columns, rows)


def by_prompt_set(root: Path, run: str) -> str:
    """One speed run per prompt set (`bench speed --prompt-set`, each in `run`/<set>), side by
    side: each method's median tok/s, its ratio to the same run's ar, and its acceptance (sd) or
    mean ESS (smc). The runs follow one another, so compare ratios within a column, not tok/s
    across columns."""
    paths = {
        name: root / run / key / "speed.jsonl"
        for key, name in report.PROMPT_SET_NAMES.items()
        if (root / run / key / "speed.jsonl").exists()  # the sets that run timed
    }
    summaries = {name: report.speed_summary(measurements(p)) for name, p in paths.items()}
    labels = list(dict.fromkeys(r["label"] for rows in summaries.values() for r in rows))
    cells = {(name, r["label"]): r for name, rows in summaries.items() for r in rows}

    def of(name: str, what: Callable[[dict[str, Any]], str]) -> Callable[[dict], str]:
        return lambda row: what(cells[name, row["label"]]) if (name, row["label"]) in cells else "-"

    columns = [Column("method", lambda r: r["label"])]
    for name in paths:
        columns += [
            Column(f"{name} tok/s", of(name, _f("median_tps"))),
            Column("vs ar", of(name, _f("vs_ar", suffix="x"))),
            Column("acceptance / ESS", of(name, _acceptance_or_ess)),
        ]
    return captions(list(paths.values()), root) + grid(columns, [{"label": x} for x in labels])


PEERS = (("llama-cpp-spec ", "llama.cpp speculative "), ("llama-cpp ", "llama.cpp "))


def _peer_name(row: dict[str, Any], precision: str) -> str:
    label = row["label"]
    for prefix, name in PEERS:
        if label.startswith(prefix):
            return name + label.removeprefix(prefix)
    return f"ours: {label}" + (f" ({precision})" if label == "ar" else "")


def _acceptance_or_ess(row: dict[str, Any]) -> str:
    if row["acceptance_rate"] is not None:
        return f"{row['acceptance_rate']:.2f}"
    if row["mean_ess"] is not None:
        return f"- (mean ESS {row['mean_ess']:.2f})"
    return "-"


# ---- `smcspec bench accuracy` and `smcspec bench serve` runs


def accuracy(root: Path, *runs: str) -> str:
    """One table over the runs' results (the same problems and settings, methods added by a
    later run), compared and plotted as one."""
    paths = [root / run / "accuracy.jsonl" for run in runs]
    rows = report.accuracy_summary([r for path in paths for r in measurements(path)])
    return captions(paths, root) + report.accuracy_table(rows)


def captions(paths: list[Path], root: Path) -> str:
    """`caption` for several runs: one line when they ran on one machine with one pair."""
    places = {source(p) for p in paths}
    if len(paths) < 2 or len(places) > 1:
        return "".join(caption(path, root) for path in paths)
    ((machine, models),) = places
    rels = ", ".join(f"`benchmarks/{p.relative_to(root).as_posix()}`" for p in paths)
    return f"*Sources: {rels}; {machine}; {models}.*\n\n"


def serve(root: Path, run: str) -> str:
    """One row per (server, method, concurrency); x is tokens/s over the same server and
    method's one-client row."""
    path = root / run / "serve.jsonl"
    rows = [dict(r) for r in measurements(path) if "method" in r]
    alone = {
        (r.get("replicas", 0), r["method"]): r["tokens_per_second"]
        for r in rows
        if r["concurrency"] == 1
    }
    for r in rows:
        r["x"] = r["tokens_per_second"] / alone[(r.get("replicas", 0), r["method"])]
        r["server"] = _server(r.get("replicas", 0))
    replicas = any(r.get("replicas") for r in rows)
    columns = [Column("server", lambda r: r["server"])] if replicas else []
    columns += [
        Column("method", lambda r: r["method"]),
        Column("C", lambda r: str(r["concurrency"])),
        Column("req/s", _f("requests_per_second")),
        Column("tok/s", _f("tokens_per_second")),
        Column("x", _f("x")),
        Column("latency mean (s)", _f("latency_mean")),
        Column("TTFT mean (s)", _f("ttft_mean")),
        Column("target rows / pass", _f("rows_per_target_pass")),
        Column("time in passes", _f("forward_share")),
        Column("acceptance", _f("acceptance")),
        Column("ESS/N", _f("ess_fraction")),
    ]
    return caption(path, root) + grid(columns, rows)


def _server(replicas: int) -> str:
    return "1 process" if not replicas else f"Ray, {replicas} replica{'s' * (replicas > 1)}"


def written(root: Path, file: str, index: int = 0) -> str:
    path = root / file
    return caption(path, root) + markdown_table(path, index)


TABLES: dict[str, Callable[[Path], str]] = {
    "cpu/speed": lambda root: engine_end_to_end(root, "cpu/engine-xeon-amx-int8", ("native",)),
    "cpu/engine-weights": lambda root: engine_by_weights(
        root, {"int8": "cpu/engine-xeon-amx-int8", "int4": "cpu/engine-xeon-amx-int4"}
    ),
    "cpu/engine-steps": lambda root: engine_steps(root, "cpu/engine-int8"),
    "cpu/engine-e2e": lambda root: engine_end_to_end(root, "cpu/engine-int8"),
    "cpu/engine-kv": lambda root: engine_kv(root, "cpu/engine-int8"),
    "cpu/llama-cpp": lambda root: against_llama_cpp(root, "cpu/llama-cpp"),
    "cpu/llama-cpp-int4": lambda root: against_llama_cpp(root, "cpu/llama-cpp-int4"),
    "cpu/llama-cpp-amx": lambda root: against_llama_cpp(root, "cpu/llama-cpp-amx/humaneval"),
    "cpu/llama-cpp-amx-mt-bench": lambda root: against_llama_cpp(
        root, "cpu/llama-cpp-amx/mt-bench"
    ),
    "cpu/sweep-int8": lambda root: speed(root, "cpu/sweep-int8"),
    "cpu/prompt-sets": lambda root: by_prompt_set(root, "cpu/prompt-sets"),
    "cpu/draft-temperature": lambda root: speed(root, "cpu/draft-temperature"),
    "cpu/auto-sweep": lambda root: speed(root, "cpu/auto-sweep"),
    "cpu/auto-sweep-best": lambda root: best_fixed(root, "cpu/auto-sweep"),
    "cpu/auto-draft-temperature": lambda root: speed(root, "cpu/auto-draft-temperature"),
    "cpu/auto-draft-temperature-best": lambda root: best_fixed(root, "cpu/auto-draft-temperature"),
    "cpu/roofline-int8": lambda root: written(root, "cpu/roofline-int8/before/roofline.md"),
    "cpu/serve": lambda root: serve(root, "cpu/serve"),
    "cpu/serve-replicas": lambda root: serve(root, "cpu/serve-replicas"),
    "cpu/accuracy-power": lambda root: accuracy(root, "cpu/accuracy-power"),
    "cpu/gsm8k": lambda root: accuracy(root, "cpu/gsm8k-k4"),
    "cpu/gsm8k-epyc": lambda root: accuracy(root, "cpu/gsm8k", "cpu/gsm8k-n4"),
    "cpu/gsm8k-heldout": lambda root: accuracy(root, "cpu/gsm8k-heldout"),
    "cpu/math500": lambda root: accuracy(root, "cpu/math500"),
    "cpu/math500-heldout": lambda root: accuracy(root, "cpu/math500-heldout"),
    "cpu/humaneval": lambda root: accuracy(root, "cpu/humaneval-int8"),
    "cpu/humaneval-heldout": lambda root: accuracy(root, "cpu/humaneval-heldout"),
    "cpu/gsm8k-settings": lambda root: accuracy(
        root, "cpu/gsm8k-k4", "cpu/gsm8k-threshold", "cpu/gsm8k-n8"
    ),
    "cpu/json": lambda root: written(root, "cpu/json/json.md"),
    "cpu/law": lambda root: written(root, "cpu/law/law.md"),
    "cpu/law-384": lambda root: written(root, "cpu/law-384/law.md"),
    "cpu/fidelity": lambda root: written(root, "cpu/int8-kernel/groups/g32/fidelity.md"),
    "gpu/estimate": lambda root: written(root, "gpu/estimate.md"),
    "gpu/estimate-e2e": lambda root: written(root, "gpu/estimate.md", 1),
}


def table(name: str, root: Path) -> str:
    if name not in TABLES:
        raise ValueError(f"unknown table {name!r}; known: {', '.join(TABLES)}")
    return TABLES[name](root)


def render(text: str, root: Path) -> str:
    """The page with every marked table regenerated from the result files under root."""
    if len(OPENING.findall(text)) != len(MARKER.findall(text)):
        raise ValueError("a '<!-- table: NAME -->' marker has no '<!-- /table -->' after it")
    return MARKER.sub(
        lambda m: f"<!-- table: {m['name']} -->\n\n{table(m['name'], root)}\n<!-- /table -->\n",
        text,
    )


def stale(text: str, root: Path) -> list[str]:
    """The names of the marked tables whose text differs from what render makes."""
    fresh = {m["name"]: m["body"] for m in MARKER.finditer(render(text, root))}
    return [m["name"] for m in MARKER.finditer(text) if fresh[m["name"]] != m["body"]]

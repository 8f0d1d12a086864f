"""The benchmark tables of README.md and docs/ are what scripts/render_tables makes from the
committed result files, and the renderer agrees with the Markdown `smcspec bench` wrote."""

import re
from pathlib import Path

import pytest

from smcspec.bench import tables

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _table_of(block: str) -> str:
    return block.split("\n\n", 1)[1]  # past the caption


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_tables_match_the_committed_runs(page: Path) -> None:
    assert tables.stale(page.read_text(), BENCH) == [], "run scripts/render_tables"


def test_the_headline_tables_are_marked() -> None:
    readme = (ROOT / "README.md").read_text()
    names = {m["name"] for m in tables.MARKER.finditer(readme)}
    assert {"cpu/speed", "cpu/llama-cpp-amx"} <= names
    used = {m["name"] for page in PAGES for m in tables.MARKER.finditer(page.read_text())}
    assert used == set(tables.TABLES), "every table is quoted somewhere, and only known ones"


def test_a_hand_edited_cell_is_stale() -> None:
    readme = (ROOT / "README.md").read_text()
    fresh = tables.render(readme, BENCH)
    speed = fresh[fresh.index("<!-- table: cpu/speed -->") :]
    found = re.search(r"\| sd K=4 \| ([0-9.]+) \|", speed)
    assert found, "the speed table has an sd K=4 row"
    cell, edited = found[0], f"| sd K=4 | {float(found[1]) + 2:.2f} |"
    assert tables.stale(fresh.replace(cell, edited), BENCH) == ["cpu/speed"]
    assert tables.render(fresh.replace(cell, edited), BENCH) == fresh


def test_marker_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="unknown table 'cpu/nope'"):
        tables.render("<!-- table: cpu/nope -->\n<!-- /table -->\n", BENCH)
    with pytest.raises(ValueError, match="no '<!-- /table -->'"):
        tables.render("<!-- table: cpu/speed -->\nhand-made\n", BENCH)
    quoted = "Write `<!-- table: cpu/speed -->` on a line of its own.\n"
    assert tables.render(quoted, BENCH) == quoted


BENCH_WROTE = {
    "engine steps": (
        lambda: tables.table("cpu/engine-steps", BENCH),
        "cpu/engine-int8/engine.md",
        0,
    ),
    "engine e2e": (lambda: tables.table("cpu/engine-e2e", BENCH), "cpu/engine-int8/engine.md", 1),
    "speed": (lambda: tables.speed(BENCH, "cpu/llama-cpp"), "cpu/llama-cpp/speed.md", 0),
    "accuracy": (
        lambda: tables.table("cpu/accuracy-power", BENCH),
        "cpu/accuracy-power/accuracy.md",
        0,
    ),
}


@pytest.mark.parametrize("case", BENCH_WROTE)
def test_the_renderer_agrees_with_what_the_bench_wrote(case: str) -> None:
    """Where a run's Markdown has the columns the renderer shows, the two are the same text
    (separator rows aside: the bench writes two styles), so the renderer's summaries are the
    bench's own."""
    render, written, index = BENCH_WROTE[case]

    def rows(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith(("|---", "| ---"))]

    assert rows(_table_of(render())) == rows(tables.markdown_table(BENCH / written, index))


def test_engine_kv_sentence_matches_the_bench() -> None:
    written = (BENCH / "cpu/engine-int8/engine.md").read_text()
    sentence = _table_of(tables.table("cpu/engine-kv", BENCH)).strip()
    assert sentence.replace(" against ", " vs ") in written


def test_runs_merged_into_one_table_name_every_source_once_per_machine() -> None:
    merged = tables.accuracy(BENCH, "cpu/gsm8k", "cpu/gsm8k-n4")
    caption, table = merged.split("\n\n", 1)
    assert caption.count("Sources: ") == 1 and caption.count("AMD EPYC") == 1
    assert "`benchmarks/cpu/gsm8k/accuracy.jsonl`" in caption
    assert "`benchmarks/cpu/gsm8k-n4/accuracy.jsonl`" in caption
    assert "smc N=4 K=8" in table and "| ar | 100 |" in table
    alone = tables.accuracy(BENCH, "cpu/gsm8k")
    assert alone.startswith("*Source: `benchmarks/cpu/gsm8k/accuracy.jsonl`;")


@pytest.mark.parametrize(
    "run, precision", [("cpu/llama-cpp", "int8"), ("cpu/llama-cpp-int4", "int4")]
)
def test_our_ar_row_against_llama_cpp_names_the_runs_own_precision(run, precision) -> None:
    table = tables.against_llama_cpp(BENCH, run)
    assert f"| ours: ar ({precision}) |" in table and "| llama.cpp Q4_K_M |" in table


def test_the_prompt_set_table_puts_each_runs_cells_in_its_own_columns() -> None:
    """Each prompt set's three columns hold that run's own summary (a table that read one run
    into every column, or shifted a column, differs)."""
    from smcspec.bench import report
    from smcspec.bench.results import measurements

    runs = ["cpu/prompt-sets/humaneval", "cpu/prompt-sets/gsm8k", "cpu/prompt-sets/mt-bench"]
    body = _table_of(tables.by_prompt_set(BENCH, "cpu/prompt-sets")).splitlines()
    assert body[0].split(" | ")[1:4] == ["HumanEval tok/s", "vs ar", "acceptance / ESS"]
    rows = {line.split(" | ")[0].lstrip("| "): line.strip("|").split(" | ") for line in body[2:]}
    for column, run in enumerate(runs):
        summary = report.speed_summary(measurements(BENCH / run / "speed.jsonl"))
        for r in summary:
            cells = rows[r["label"]][1 + 3 * column : 4 + 3 * column]
            assert cells[0].strip() == report._fmt(r["median_tps"], 2)
            assert cells[1].strip() == ("1.00x" if r["label"] == "ar" else f"{r['vs_ar']:.2f}x")

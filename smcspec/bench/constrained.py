"""`smcspec bench json`: constrained JSON generation. How often the output is valid JSON that
fits a schema, and what the constraint costs in tokens/s: free and masked `ar`, free and
constrained `smc`, interleaved prompt by prompt in one process."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from tqdm import tqdm

from smcspec.bench import machine

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
PROMPTS = (
    "Describe a fictional software engineer as a JSON object with name, age and languages.",
    "Give me a JSON record for a made-up data scientist: name, age, programming languages.",
    "Return only JSON: a person called Ada who is 36 and writes Python and C.",
    "Invent a student who codes; answer as JSON with keys name, age, languages.",
    "JSON please: a retired developer, their age and the languages they used.",
)
FENCE = re.compile(r"```(?:json)?\s*\n(.*?)(?:```|$)", re.DOTALL)


def fits_schema(text: str) -> bool:
    """Valid JSON (a fenced block is unwrapped) with exactly the schema's keys and types."""
    block = FENCE.search(text)
    try:
        value = json.loads(block.group(1) if block else text)
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age", "languages"}
        and isinstance(value["name"], str)
        and isinstance(value["age"], int)
        and not isinstance(value["age"], bool)
        and isinstance(value["languages"], list)
        and all(isinstance(x, str) for x in value["languages"])
    )


def contenders(particles: int, draft_tokens: int) -> list[tuple[str, str, dict]]:
    smc = {"particles": particles, "draft_tokens": draft_tokens}
    return [
        ("ar", "ar", {}),
        ("ar masked", "ar", {"json_schema": SCHEMA}),
        (f"smc N={particles} K={draft_tokens}", "smc", smc),
        (f"smc N={particles} K={draft_tokens} constrained", "smc", {**smc, "json_schema": SCHEMA}),
    ]


def run_json(
    llm, out_dir: str | Path, particles: int, draft_tokens: int, reps: int, max_new: int
) -> str:
    rows: dict[str, list[dict]] = {}
    plan = contenders(particles, draft_tokens)
    for _, method, settings in plan:  # untimed warm-up (and the position-0 memo)
        llm.generate(PROMPTS[0], method, max_new_tokens=4, seed=0, **settings)
    jobs = [(rep, i, c) for rep in range(reps) for i in range(len(PROMPTS)) for c in plan]
    for rep, i, (label, method, settings) in tqdm(jobs, desc="bench json", unit="run"):
        out = llm.generate(
            PROMPTS[i], method, max_new_tokens=max_new, seed=1000 * rep + i, **settings
        )
        rows.setdefault(label, []).append(
            {
                "valid": fits_schema(out.text),
                "tps": out.diagnostics["tokens_per_second"],
                "complete": out.diagnostics.get("complete", True),
            }
        )
    lines = [
        f"Constrained JSON: {machine.one_line(machine.describe(llm.dtype))}; "
        f"target {llm.names[0]}, draft {llm.names[1]}; {len(PROMPTS)} prompts x {reps} seeds, "
        f"T=0.7, up to {max_new} new tokens, stop at EOS. Valid = parses as JSON (a fenced "
        "block unwrapped) with exactly the schema's keys and types.",
        "",
        "| method | valid | tok/s (mean) |",
        "|---|---|---|",
    ]
    for label, _, _ in plan:
        rs = rows[label]
        valid = sum(r["valid"] for r in rs)
        tps = statistics.mean(r["tps"] for r in rs)
        lines.append(f"| {label} | {valid}/{len(rs)} | {tps:.2f} |")
    text = "\n".join(lines) + "\n"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "json.md").write_text(text)
    return text

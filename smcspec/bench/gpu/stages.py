"""One run of `smcspec bench gpu` as stages: `Run.stage` calls one part of the run, turns an
exception into a crash row (its traceback kept) and a stage past the deadline into a not-run
row, and rewrites gpu.md after every stage, so that a run cut short at any point keeps its
report so far. `Outcome` is what the run leaves, and scripts/gpu_check's exit code."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smcspec.bench.gpu.pairs import Deadline, GpuPlan
from smcspec.bench.gpu.report import run_header, write_report
from smcspec.bench.results import ResultLog

# scripts/gpu_check's exit codes
PASSED, CHECK_FAILED, BAD_OPTIONS, CRASHED, INCOMPLETE = 0, 1, 2, 3, 4


class Run:
    """One `run_all`: its result log, its deadline, and what each stage left. Every stage is
    one call through `stage`, which turns an exception into a crash row (the traceback kept)
    and rewrites gpu.md, so that a run killed at any point leaves its report so far."""

    def __init__(self, plan: GpuPlan, out_dir: str | Path, deadline: Deadline) -> None:
        self.plan, self.out_dir, self.deadline = plan, Path(out_dir), deadline
        path = self.out_dir / "gpu.jsonl"
        path.unlink(missing_ok=True)
        self.log = ResultLog(path, run_header(plan))
        self.failures: list[str] = []  # checks that failed
        self.unchecked: list[str] = []  # checks that did not run
        self.skipped: list[str] = []  # measurements that did not run
        self.crashed: list[str] = []  # stages that raised
        self.report = ""

    def stage(self, name: str, fn: Callable[..., Any], *args: Any, checks: bool = False) -> Any:
        """fn(*args), or None when the deadline has passed (a not-run row) or it raised (a
        crash row with the traceback)."""
        if self.deadline.passed():
            self.not_run(name, "time budget", checks)
            return None
        start = time.monotonic()
        try:
            return fn(*args)
        except Exception:
            self.crashed.append(name)
            self.log.add(f"crash|{name}", {"stage": name, "traceback": traceback.format_exc()})
            if checks:
                self.unchecked.append(f"{name} (raised)")
            return None
        finally:
            self.log.add(f"stage|{name}", {"stage": name, "seconds": time.monotonic() - start})
            self.write()

    def checks(self, name: str, fn: Callable[..., list[dict]], *args: Any) -> None:
        """A stage whose result is check rows: each logged, and counted as failed or not run."""
        for row in self.stage(name, fn, *args, checks=True) or []:
            self.log.add(f"check|{row['check']}", row)
            if row["ok"] is None:
                self.unchecked.append(row["failure"])
            elif not row["ok"]:
                self.failures.append(row["failure"])
        self.write()

    def record(self, key: str, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A stage whose result is one measurement, logged under `key`."""
        value = self.stage(name, fn, *args)
        if value is not None:
            self.log.add(key, value if isinstance(value, dict) else {"value": value})
            self.write()
        return value

    def not_run(self, name: str, why: str, checks: bool = False) -> None:
        self.log.add(f"not-run|{name}", {"stage": name, "why": why, "checks": checks})
        (self.unchecked if checks else self.skipped).append(f"{name} ({why})")

    def not_run_rows(self, prefix: str, rows: dict[str, Any]) -> None:
        """A not-run row for each row a stage left None (the deadline passed inside it)."""
        for row, value in rows.items():
            if value is None:
                self.not_run(f"{prefix}: {row}", "time budget")
        self.write()

    def write(self) -> None:
        """gpu.md from gpu.jsonl as it stands; a report that cannot be written leaves the
        reason in gpu.md instead (gpu.jsonl still holds every record)."""
        try:
            self.report = write_report(self.out_dir)
        except Exception:
            self.report = (
                "# gpu.md could not be written\n\n```\n" + traceback.format_exc() + "```\n"
            )
            (self.out_dir / "gpu.md").write_text(self.report)


@dataclass
class Outcome:
    failures: list[str]  # correctness checks that failed
    skipped: list[str]  # what did not run: checks first, then measurements
    report: str  # the Markdown written to gpu.md
    crashed: list[str] = field(default_factory=list)  # stages that raised
    unchecked: list[str] = field(default_factory=list)  # the checks among `skipped`

    @property
    def exit_code(self) -> int:
        """1 a check failed, 3 a stage raised, 4 a check did not run, else 0."""
        if self.failures:
            return CHECK_FAILED
        if self.crashed:
            return CRASHED
        return INCOMPLETE if self.unchecked else PASSED

    def verdict(self) -> str:
        """The correctness line: "passed" only when every check ran and passed."""
        if self.failures:
            return f"FAILED ({len(self.failures)} checks)"
        if self.unchecked:
            return f"incomplete ({len(self.unchecked)} checks not run)"
        return "passed"

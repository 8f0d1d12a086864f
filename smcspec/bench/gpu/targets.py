"""The GPU targets of issue 26, judged from a `bench gpu` result file's records: each target a
ratio read from the records, its bound, and pass / miss (or not run, when a record it needs is
missing). Pure functions of the records: the report calls them, and so can a test."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

Records = dict[str, dict]


@dataclass(frozen=True)
class Target:
    what: str  # the target, as the issue states it
    bound: float
    at_most: bool  # the ratio must be <= bound (else >= bound)
    ratio: Callable[[str, Records], float | None]  # (pair, records) -> the measured ratio

    def judge(self, name: str, records: Records) -> tuple[float | None, bool | None]:
        """The measured ratio and whether it meets the bound (None: not measured)."""
        value = self.ratio(name, records)
        if value is None:
            return None, None
        return value, (operator.le if self.at_most else operator.ge)(value, self.bound)


def _steps(name: str, records: Records) -> dict:
    return records.get(f"steps|{name}|graphs", {}).get("ms", {})


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def step_over_floor(name: str, records: Records) -> float | None:
    return _div(
        _steps(name, records).get("target step"), records.get(f"floor|{name}", {}).get("floor_ms")
    )


def verify_over_step(name: str, records: Records) -> float | None:
    """The 8 x 9 = 72-row verify against a one-token step, both at 2048 keys."""
    long = records.get(f"long|{name}", {})
    return _div(long.get("verify 8x9 at 2048"), long.get("target step at 2048"))


def attention_share(name: str, records: Records) -> float | None:
    """Every layer's attention alone (the kernel timed on one sequence of 4096 keys) over a
    one-token step at 4096 keys; only for a target of the kernel's head shape."""
    kernel, floor = records.get("kernel", {}), records.get(f"floor|{name}", {})
    if not kernel or kernel.get("heads") != floor.get("heads"):
        return None
    per_layer = kernel["ms"].get("1 x 1 at 4096")
    step = records.get(f"long|{name}", {}).get("target step at 4096")
    return _div(per_layer * floor["layers"] if per_layer else None, step)


def slowest_draft_step(name: str, records: Records) -> float | None:
    """The slowest graphs draft step at batch 1 to 8, in ms."""
    steps = _steps(name, records)
    ms = [
        v for k, v in steps.items() if k.startswith("draft step batch ") and int(k.split()[-1]) <= 8
    ]
    return None if not ms or None in ms else max(ms)


def _decode(name: str, records: Records, label: str) -> float | None:
    return records.get(f"e2e|{name}|graphs|{label}", {}).get("decode_tokens_per_second")


def smc_over_ar(name: str, records: Records) -> float | None:
    return _div(_decode(name, records, "smc N=8 K=8"), _decode(name, records, "ar"))


def sd_over_ar(name: str, records: Records) -> float | None:
    """Predicted (the real pair's acceptance over this device's step costs): random weights
    make the measured sd acceptance meaningless."""
    sd = records.get(f"sd-predicted|{name}", {}).get("decode_tokens_per_second")
    return _div(sd, _decode(name, records, "ar"))


def prefill_memory(name: str, records: Records) -> float | None:
    """Peak device memory of the long prefill over the device's; inf when it ran out."""
    r = records.get(f"prefill|{name}")
    if not r:
        return None
    if not r["fits"]:
        return math.inf
    return _div(r.get("peak_bytes"), r.get("device_bytes"))


def syncs(label: str) -> Callable[[str, Records], float | None]:
    def per_round(name: str, records: Records) -> float | None:
        return records.get(f"syncs|{name}|{label}", {}).get("syncs_per_round")

    return per_round


TARGETS = (
    Target("target step <= 1.3x its floor", 1.3, True, step_over_floor),
    Target("72-row verify at 2048 keys <= 1.3x a one-token step", 1.3, True, verify_over_step),
    Target("attention < 15% of a step at 4096 keys", 0.15, True, attention_share),
    Target("draft step <= 1 ms at batch 1-8 (slowest, ms)", 1.0, True, slowest_draft_step),
    Target("smc N=8 K=8 >= 2.5x ar (decode, graphs)", 2.5, False, smc_over_ar),
    Target("sd K=4 >= 2x ar (decode, predicted at a = 0.95)", 2.0, False, sd_over_ar),
    Target("host syncs per sd K=4 round <= 1", 1.0, True, syncs("sd K=4")),
    Target("host syncs per smc N=8 K=8 round <= 1", 1.0, True, syncs("smc N=8 K=8")),
    Target("a 32k-token prefill fits (peak / device memory)", 1.0, True, prefill_memory),
)


def targets_table(pairs: list[str], records: Records) -> list[str]:
    """Markdown rows: pair, target, measured, pass / miss / not run."""
    lines = ["| pair | target | measured | result |", "|---|---|---|---|"]
    for name in pairs:
        for target in TARGETS:
            value, ok = target.judge(name, records)
            shown = "-" if value is None else f"{value:.3g}"
            result = {True: "pass", False: "**miss**", None: "not run"}[ok]
            lines.append(f"| {name} | {target.what} | {shown} | {result} |")
    return lines

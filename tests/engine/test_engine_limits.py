"""`LLM(..., limits=EngineLimits(...))`: the pool the native engine gets, the request it then
refuses (naming the pool and the flag that grows it), and `generate_batch` and the scheduler
reading max_running / max_batch_tokens from the limits, their defaults from `EngineLimits`."""

import time
from dataclasses import dataclass

import pytest
import torch

from smcspec import LLM
from smcspec.config import EngineLimits
from smcspec.engine import llm as llm_module
from smcspec.engine import scheduler as scheduler_module
from smcspec.engine.scheduler import Scheduler

PROMPT = [3, 4, 5]


@pytest.fixture(scope="module")
def small(tiny_llama_folder, tiny_llama_draft_folder):
    """The tiny pair over pools of 8 pages of 16 positions: its whole context (128), once."""
    target, draft = str(tiny_llama_folder), str(tiny_llama_draft_folder)
    limits = EngineLimits(kv_pages=8)
    return LLM(target, draft, backend="native", dtype="float32", limits=limits)


def test_kv_pages_sizes_both_pools(small):
    """Failed on: LLM.__init__ not passing its limits to load_pair (pools of 4096 pages)."""
    assert small.limits == EngineLimits(kv_pages=8)
    for model in (small.target, small.draft):
        assert model.pages.num_pages == 8 and model.page_size == 16


def test_a_request_longer_than_the_pool_is_refused_naming_the_pool_and_the_flag(small):
    """3 + 120 positions need 8 pages and the one spare the scheduler keeps per row: 9 > 8.
    Failed on: the admission message without the pool's size or the flag."""
    [short] = small.generate_batch([PROMPT], method="ar", max_new_tokens=8, stop_at_eos=False)
    assert len(short.token_ids) == 8
    message = r"needs up to 9 KV pages .* \(8 pages x 16 positions\).*--kv-pages or --kv-memory"
    with pytest.raises(ValueError, match=message):
        small.generate_batch([PROMPT], method="ar", max_new_tokens=120, stop_at_eos=False)


@pytest.fixture
def schedulers(monkeypatch) -> list[Scheduler]:
    """Every scheduler `generate_batch` builds from now on."""
    made = []

    class Spy(Scheduler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(llm_module, "Scheduler", Spy)
    return made


def test_generate_batch_reads_the_llms_limits_unless_overridden(small, schedulers, monkeypatch):
    """Failed on: generate_batch building its scheduler from EngineLimits() (64 / 256)."""
    monkeypatch.setattr(small, "limits", EngineLimits(max_running=2, max_batch_tokens=5))
    small.generate_batch([PROMPT], method="ar", max_new_tokens=2)
    small.generate_batch([PROMPT], method="ar", max_new_tokens=2, max_batch_tokens=7)
    got = [(s.max_running, s.max_batch_tokens) for s in schedulers]
    assert got == [(2, 5), (2, 7)]


def test_the_schedulers_defaults_are_engine_limits(small, monkeypatch):
    """Scheduler's defaults come from `EngineLimits`, read when it is built: another default
    there reaches it. Failed on: Scheduler's own literal defaults (64, 256)."""

    def limits_of(scheduler: Scheduler) -> tuple[int, int]:
        scheduler.shutdown()
        return scheduler.max_running, scheduler.max_batch_tokens

    defaults = EngineLimits()
    assert limits_of(Scheduler((small.target,))) == (64, 256)
    assert (defaults.max_running, defaults.max_batch_tokens) == (64, 256)

    @dataclass(frozen=True)
    class Other(EngineLimits):
        max_running: int = 3
        max_batch_tokens: int = 11

    monkeypatch.setattr(scheduler_module, "EngineLimits", Other)
    assert limits_of(Scheduler((small.target,))) == (3, 11)
    assert limits_of(Scheduler((small.target,), max_running=5)) == (5, 11)


def test_the_scheduler_refuses_bad_limits_by_name(small):
    for field in ("max_running", "max_batch_tokens"):
        with pytest.raises(ValueError, match=f"^{field} must be an integer >= 1"):
            Scheduler((small.target,), **{field: 0})


def test_a_pool_size_for_models_without_one_is_refused(small, tiny_llama_folder, monkeypatch):
    """The hf backend has no paged pool, and models built elsewhere bring their own: a size
    given for them is refused, the hf one before any weights load. Failed on: the hf backend
    loading and ignoring kv_pages."""

    def load(*args, **kwargs):
        raise AssertionError("weights loaded before the check")

    monkeypatch.setattr("smcspec.models.hf.load", load)
    folder = str(tiny_llama_folder)
    with pytest.raises(ValueError, match="hf backend has none"):
        LLM(folder, folder, backend="hf", dtype="float32", limits=EngineLimits(kv_pages=8))
    with pytest.raises(ValueError, match="bring their own pools"):
        LLM.from_models(small.target, small.draft, limits=EngineLimits(kv_memory=0.5))
    limits = EngineLimits(max_running=3)
    assert LLM.from_models(small.target, small.draft, limits=limits).limits is limits


# -- each limit at the limit and one past it, where the engine enforces it -------------------


@pytest.mark.parametrize(("new_tokens", "fits"), [(109, True), (110, False)], ids=["at", "past"])
def test_a_request_needing_the_whole_pool_runs_and_one_page_more_is_refused(
    small, new_tokens, fits
):
    """3 + 109 positions fill 7 pages, with the spare page: 8, the pool; 3 + 110 need 9.
    Failed on: the admission check `need >= cap` (at)."""
    run = lambda: small.generate_batch(  # noqa: E731
        [PROMPT], method="ar", max_new_tokens=new_tokens, stop_at_eos=False
    )
    if fits:
        assert len(run()[0].token_ids) == new_tokens
    else:
        with pytest.raises(ValueError, match="needs up to 9 KV pages"):
            run()


@pytest.mark.parametrize(("prompt_tokens", "together"), [(4, True), (5, False)], ids=["at", "past"])
def test_a_pass_carries_max_batch_tokens_and_not_one_more(small, prompt_tokens, together):
    """A prompt and a step of 3 rows x 2 tokens under a budget of 10 tokens: 4 + 6 fill it and
    go in one pass, 5 + 6 do not (the prompt, oldest, goes alone). Failed on: the budget check
    letting a pass reach only `max_batch_tokens - 1` (at)."""
    scheduler = Scheduler((small.target,), max_batch_tokens=10)
    try:
        cache = small.target.new_cache()
        prompt = scheduler_module._Call(0, torch.ones(1, prompt_tokens, dtype=torch.long), cache, 1)
        step = scheduler_module._Call(0, torch.ones(3, 2, dtype=torch.long), cache, 2)
        pieces = [(c is prompt, a, b) for c, a, b in scheduler._pieces([prompt, step])]
    finally:
        scheduler.shutdown()
    alone = [(True, 0, prompt_tokens)]
    assert pieces == ([*alone, (False, 0, 2)] if together else alone)


@pytest.mark.parametrize("max_running", [1, 2])
def test_max_running_jobs_run_at_once_and_the_next_one_waits(
    tiny_llama_folder, tiny_llama_draft_folder, max_running
):
    """max_running + 1 long jobs at once: exactly max_running of them ever run together, the
    last waits its turn. Failed on: admission while `running < max_running - 1` (at: one fewer
    ran) and while `running <= max_running` (past: all ran)."""
    folders = str(tiny_llama_folder), str(tiny_llama_draft_folder)
    llm = LLM(*folders, backend="native", dtype="float32")  # the default pool: pages never bind
    scheduler = Scheduler((llm.target, llm.draft), max_running=max_running)
    try:
        plans = [
            llm.request(PROMPT, "ar", max_new_tokens=100, stop_at_eos=False, chat=False)
            for _ in range(max_running + 1)
        ]
        jobs = scheduler.submit_all([llm.job(p) for p in plans])
        seen, end = set(), time.monotonic() + 60
        while not all(j.future.done() for j in jobs):
            assert time.monotonic() < end, f"jobs still running after 60 s: {sorted(seen)}"
            seen.add((scheduler.running, scheduler.queued))
            time.sleep(0.001)
    finally:
        scheduler.shutdown()
    assert max(running for running, _ in seen) == max_running, sorted(seen)
    assert (max_running, 1) in seen, sorted(seen)

"""Admission by page budget, at the pool's bound: what the scheduler reserves for a job covers
every page the job holds, smc particles that share a partial last page (and copy it on write)
included, so jobs admitted up to the last page of the pool all finish.

The bound a job's rows can reach is the test's own arithmetic: rows x ceil(positions / page
size), a row holding at most the prompt, the new tokens and one round of drafts (K) past them.
Every allocated page sits in some row's page table (a copy on write allocates the row's own page
and drops its share of the old one), so the distinct pages never exceed the sum of the rows'
tables. A decoder or cache that leaks a page, or copies one it does not need to, goes over it;
pools here hold exactly that many pages, so going over is an out-of-pages error mid-decode.

The scheduler reserves one page per row more than this bound (`Scheduler.pages_for`: "for the
copy-on-write of a shared last page"). The first test's pools leave that page out and every job
still finishes: by the argument above, the copy on write never needs it."""

import threading

import pytest

from smcspec import LLM
from smcspec.engine.job import Job
from smcspec.engine.scheduler import Scheduler
from smcspec.kv.cache import PagedKVCache
from smcspec.models.native import NativeCausalLM

PAGE = 4
PROMPT = "w1 w2 w3 w4"  # 4 ids: the prefill leaves 3 positions, a partial page the rows share
SETTINGS = [
    dict(method="smc", particles=4, draft_tokens=3),
    dict(method="smc", particles=3, draft_tokens=5),
    dict(method="sd", draft_tokens=3),
    dict(method="ar"),
]


@pytest.fixture(scope="module")
def llm(tiny_llama_folder, tiny_llama_draft_folder):
    target, draft = str(tiny_llama_folder), str(tiny_llama_draft_folder)
    return LLM(target, draft, backend="native", dtype="float32")


@pytest.fixture
def copies(monkeypatch) -> list[int]:
    """The sequences whose shared last page was copied on write, from now on."""
    seen = []
    real = PagedKVCache._copy_last_page

    def spy(self, seq):
        seen.append(seq)
        real(self, seq)

    monkeypatch.setattr(PagedKVCache, "_copy_last_page", spy)
    return seen


def pooled(llm: LLM, target_pages: int, draft_pages: int) -> LLM:
    """The same weights over pools of exactly these many pages of PAGE positions."""

    def pool(m, pages):
        return NativeCausalLM(m.model, set(m.eos_token_ids), num_pages=pages, page_size=PAGE)

    return LLM.from_models(
        pool(llm.target, target_pages), pool(llm.draft, max(draft_pages, 1)), llm.tokenizer
    )


def bound(settings: dict, prompt_ids: list[int], max_new_tokens: int) -> tuple[int, int]:
    """Pages of (target, draft) a request's rows can hold, by this file's arithmetic."""
    rows = settings.get("particles", 1)
    k = settings.get("draft_tokens", 0)
    pages = rows * -(-(len(prompt_ids) + max_new_tokens + k) // PAGE)
    return pages, (0 if settings["method"] == "ar" else pages)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("max_new_tokens", [6, 11])
def test_a_job_runs_in_a_pool_of_its_bound_and_reserves_at_least_that(
    llm, copies, settings, max_new_tokens
):
    request = llm.request(PROMPT, max_new_tokens=max_new_tokens, stop_at_eos=False, **settings)
    target, draft = bound(settings, request.prompt_ids, max_new_tokens)
    tight = pooled(llm, target, draft)
    out = tight.run(request)
    assert len(out.token_ids) == max_new_tokens
    assert tight.target.pages.peak_used <= target and tight.draft.pages.peak_used <= draft
    assert tight.target.pages.used_pages == 0 and tight.draft.pages.used_pages == 0
    if settings.get("particles", 1) > 1:
        assert copies, "the particles never shared a partial last page"
    scheduler = Scheduler((tight.target, tight.draft))
    try:
        reserved = scheduler.pages_for(request.kv_rows(), request.max_length())
    finally:
        scheduler.shutdown()
    assert reserved[0] >= target and reserved[1] >= draft


def test_jobs_admitted_to_the_last_page_of_the_pool_all_finish(llm, copies):
    """Three smc jobs whose particles share a partial last page fill the pool exactly: all three
    run at once, a fourth waits, and every one decodes what it decodes alone."""
    settings = dict(method="smc", particles=4, draft_tokens=3, max_new_tokens=9)
    probe = llm.request(PROMPT, stop_at_eos=False, **settings)
    one = pooled(llm, 1, 1)  # pools of PAGE positions a page, as the full ones below
    scheduler = Scheduler((one.target, one.draft))
    need = scheduler.pages_for(probe.kv_rows(), probe.max_length())
    scheduler.shutdown()
    full = pooled(llm, 3 * need[0], 3 * need[1])
    requests = [full.request(PROMPT, stop_at_eos=False, seed=s, **settings) for s in range(4)]
    alone = [full.run(r).token_ids for r in requests]
    gate = threading.Event()  # no job may finish (and free its pages) before all are submitted

    def gated(request):
        job = full.job(request)
        work = job.work

        def wait_then_work(views):
            assert gate.wait(30)
            return work(views)

        return Job(wait_then_work, job.rows, job.max_length)

    scheduler = Scheduler((full.target, full.draft), max_running=8)
    try:
        jobs = [scheduler.submit(gated(r)) for r in requests]
        assert (scheduler.running, scheduler.queued) == (3, 1)
        gate.set()
        together = [j.future.result(timeout=60).token_ids for j in jobs]
    finally:
        gate.set()
        scheduler.shutdown()
    assert together == alone
    assert copies
    assert full.target.pages.used_pages == 0 and full.draft.pages.used_pages == 0
    assert scheduler.stats.failed == 0

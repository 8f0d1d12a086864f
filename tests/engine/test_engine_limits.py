"""`LLM(..., limits=EngineLimits(...))`: the pool the native engine gets, the request it then
refuses (naming the pool and the flag that grows it), and `generate_batch` and the scheduler
reading max_running / max_batch_tokens from the limits, their defaults from `EngineLimits`."""

from dataclasses import dataclass

import pytest

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

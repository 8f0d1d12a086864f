"""The KV pools' budget (`engine.pools`): auto cut down to the settings its pool holds, the
request no setting fits refused before it decodes, and a profile that runs out of pages giving
them back. The tiny pair over pools of 8 pages of 16 positions; a 3-token prompt."""

import pytest

from smcspec import LLM
from smcspec.config import ARConfig, AutoConfig, EngineLimits
from smcspec.engine import costs as cm
from smcspec.engine import pools, timing
from smcspec.kv.pages import OutOfPages

PROMPT = [3, 4, 5]
# every row free and drafts nearly so: auto's choice is then as many rows and drafts as it may
ROWS_FREE = cm.StepCosts(target_fit=(1.0, 0.0), draft_fit=(0.01, 0.0))


@pytest.fixture
def small(tiny_llama_folder, tiny_llama_draft_folder):
    target, draft = str(tiny_llama_folder), str(tiny_llama_draft_folder)
    llm = LLM(target, draft, backend="native", dtype="float32", limits=EngineLimits(kv_pages=8))
    llm.tuner.costs = ROWS_FREE
    return llm


def fit(llm: LLM, config, new_tokens: int, has_potential: bool = False):
    models = (llm.target, llm.draft)
    return pools.fit_auto(config, models, len(PROMPT), new_tokens, has_potential)


# Pages a row: ceil((3 + new + K) / 16) + the spare; rows x that must be <= 8.
@pytest.mark.parametrize(
    ("config", "new_tokens", "fitted"),
    [
        (AutoConfig(), 5, AutoConfig()),  # 16 positions: 2 pages x 4 rows
        (AutoConfig(), 20, AutoConfig(max_particles=2)),  # 31: 3 x 4 > 8, 3 x 2
        (AutoConfig(), 60, AutoConfig(max_particles=1)),  # 71: 6 x 2 > 8, 6 x 1
        (AutoConfig(), 104, AutoConfig(max_particles=1, max_draft_tokens=4)),  # 115: 9; 111: 8
        (AutoConfig(), 109, ARConfig()),  # 113 at K = 1: 9; ar's 112: 8
        (AutoConfig(exact=False), 60, ARConfig()),  # smc needs 2 rows: 2 x 5 at K = 1 > 8
        (AutoConfig(particles=4), 20, AutoConfig(particles=4)),  # N given: never cut (refused)
        (AutoConfig(draft_tokens=8), 100, AutoConfig(draft_tokens=8, max_particles=1)),  # 111
        (AutoConfig(draft_tokens=8), 109, AutoConfig(draft_tokens=8)),  # K given: no ar
    ],
)
def test_auto_weighs_only_what_the_pool_holds(small, config, new_tokens, fitted):
    """Failed on: auto reserving its most (4 rows, 8 drafts) whatever the pool (a request
    over the pool refused though ar fits, or one under it choosing rows it has no pages for);
    a given N or K cut."""
    assert fit(small, config, new_tokens) == fitted


@pytest.mark.parametrize(
    ("new_tokens", "fitted"),
    [(20, AutoConfig(max_particles=2)), (60, AutoConfig())],  # 60: 2 x 5 at K = 1 > 8, no ar
)
def test_with_a_potential_auto_is_never_cut_below_smc(small, new_tokens, fitted):
    """p phi / Z needs smc's population: 2 rows at the least, and never ar."""
    assert fit(small, AutoConfig(), new_tokens, has_potential=True) == fitted


def test_an_auto_request_longer_than_its_most_runs_to_its_end_on_what_fits(small):
    """Rows free: unfitted, auto would choose 4 rows, which 8 pages cannot hold for 20 tokens
    (alone: "sequence 2 needs 1 pages, 0 free" mid-decode; batched: refused). Failed on: no fit."""
    out = small.generate(PROMPT, max_new_tokens=20, stop_at_eos=False, seed=0)
    assert len(out.token_ids) == 20
    assert max(s.get("particles", 1) for s in out.diagnostics["settings"]) == 2
    [batched] = small.generate_batch([PROMPT], max_new_tokens=109, stop_at_eos=False, seed=0)
    assert len(batched.token_ids) == 109 and batched.method == "ar"


def test_a_given_n_that_no_pool_holds_is_refused_before_decoding(small):
    with pytest.raises(ValueError, match=r"needs up to 12 KV pages .*8 pages x 16 positions"):
        small.generate(PROMPT, particles=4, max_new_tokens=20, stop_at_eos=False)
    assert small.target.pages.free_pages == small.draft.pages.free_pages == 8


def test_a_profile_out_of_pages_gives_its_pages_back(small):
    """4 rows of 100 positions need 28 pages of 8. Failed on: time_shapes releasing its cache
    only when it finished (the pool left empty: the request after it failed mid-decode)."""
    with pytest.raises(OutOfPages):
        ids = [i % small.vocab_size for i in range(100)]
        timing.time_shapes(small.target, ids, 4, [1], 1)
    assert small.target.pages.free_pages == 8

"""The native engine behind `LLM`: pages go back to the pool after every generate, even one
that fails half way, so a long-lived engine (a server) never runs out of them."""

import pytest

from smcspec import LLM


@pytest.fixture(scope="module")
def llm(tiny_folder, tiny_draft_folder):
    return LLM(str(tiny_folder), str(tiny_draft_folder), backend="native", dtype="float32")


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_generate_returns_every_page(llm, method):
    pools = (llm.target.kv.allocator, llm.draft.kv.allocator)
    own = {"ar": {}, "sd": {"draft_tokens": 3}, "smc": {"particles": 4, "draft_tokens": 3}}
    for seed in range(3):
        out = llm.generate([4, 5, 6, 7], method, max_new_tokens=20, seed=seed, **own[method])
        assert out.token_ids
        assert [p.used_pages for p in pools] == [0, 0]
    assert pools[0].peak_used > 0


def test_a_failing_generate_returns_every_page(llm, monkeypatch):
    calls = {"n": 0}
    forward = llm.target.forward

    def failing(tokens, cache, num_logits):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return forward(tokens, cache, num_logits)

    monkeypatch.setattr(llm.target, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([4, 5, 6], "smc", particles=3, draft_tokens=2, max_new_tokens=12, seed=0)
    assert llm.target.kv.allocator.used_pages == 0 == llm.draft.kv.allocator.used_pages

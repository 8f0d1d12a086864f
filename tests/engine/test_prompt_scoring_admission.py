"""A scored prompt (`prompt_logprobs`) under the scheduler: its logits come in blocks no larger
than a pass carries (it runs through chunked prefill like any prompt), and its KV pages stay
within what admission reserved for its job."""

import pytest

from smcspec import LLM
from smcspec.engine.scheduler import Scheduler
from smcspec.models.native import NativeCausalLM
from smcspec.models.toy import perturbed_lm, random_lm

PROMPT = [(5 * t + 2) % 9 + 1 for t in range(30)]


def recording(monkeypatch, model) -> list[tuple[int, int]]:
    """(tokens, logits rows) of every forward call `model` serves, in order."""
    calls: list[tuple[int, int]] = []
    inner = model.forward

    def forward(tokens, cache, num_logits):
        out = inner(tokens, cache, num_logits)
        calls.append((tokens.shape[1], out.shape[1]))
        return out

    monkeypatch.setattr(model, "forward", forward)
    return calls


def test_a_scored_prompt_runs_in_blocks_no_larger_than_a_pass(monkeypatch):
    """With room for 4 tokens a pass, a 30-token prompt is scored 4 positions at a time (one
    pass of 29 tokens and 29 x V logits before, as when the chunk ignores the view's
    `pass_tokens`), with the scores it gets alone."""
    target = random_lm(10, seed=3, scale=2.0)
    llm = LLM.from_models(target, perturbed_lm(target, seed=4, noise=1.0))
    settings = dict(method="ar", seed=0, max_new_tokens=2, prompt_logprobs=2, top_k=5)
    alone = llm.generate(PROMPT, **settings)
    calls = recording(monkeypatch, target)
    [batched] = llm.generate_batch([PROMPT], max_batch_tokens=4, **settings)
    assert max(tokens for tokens, _ in calls) <= 4
    assert max(rows for _, rows in calls) == 4
    assert batched.prompt_logprobs.chosen[1:] == alone.prompt_logprobs.chosen[1:]
    assert batched.prompt_logprobs.top == alone.prompt_logprobs.top
    assert batched.token_ids == alone.token_ids


@pytest.fixture(scope="module")
def native(tiny_llama_folder, tiny_llama_draft_folder):
    return LLM(
        str(tiny_llama_folder), str(tiny_llama_draft_folder), backend="native", dtype="float32"
    )


def test_scoring_stays_within_the_pages_its_job_reserved(native):
    """Two scored requests over a pool of exactly one job's reservation: the second waits, both
    finish with the scores they get alone, no more pages are ever in use than one job reserved,
    and every page comes back (a scoring cache kept past its job starves the next one)."""
    request = native.request(
        PROMPT, "sd", seed=1, max_new_tokens=6, draft_tokens=2, prompt_logprobs=1
    )
    alone = native.run(request)

    def pool(m, pages: int):
        return NativeCausalLM(m.model, set(m.eos_token_ids), num_pages=pages, page_size=4)

    big = Scheduler((pool(native.target, 1000), pool(native.draft, 1000)))
    need = big.pages_for(request.kv_rows(), request.max_length())
    big.shutdown()
    small = LLM.from_models(
        pool(native.target, need[0]), pool(native.draft, need[1]), native.tokenizer
    )
    small.target.pages.reset_peak()
    scheduler = Scheduler((small.target, small.draft), max_batch_tokens=8)
    try:
        jobs = [scheduler.submit(small.job(request)) for _ in range(2)]
        results = [job.future.result(timeout=60) for job in jobs]
    finally:
        scheduler.shutdown()
    for out in results:
        assert out.token_ids == alone.token_ids
        assert out.prompt_logprobs.chosen[1:] == pytest.approx(alone.prompt_logprobs.chosen[1:])
    assert small.target.pages.peak_used <= need[0]
    assert small.target.pages.used_pages == 0 and small.draft.pages.used_pages == 0

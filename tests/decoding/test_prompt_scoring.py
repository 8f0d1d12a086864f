"""Prompt scoring (`prompt_logprobs`, `echo` with `logprobs`) holds a bounded block of logits
whatever the prompt's length, and scores exactly what one pass over the prompt scores."""

import math

import pytest
import torch

from smcspec import sampling
from smcspec.config import SamplingConfig
from smcspec.decoding.logprobs import SCORE_BYTES, score_chunk, score_prompt, score_prompt_whole
from smcspec.models.toy import ToyCache, random_lm

TOP = 3
# Penalties make each prompt token's law depend on every token before it, so a block scored
# with the wrong context (one token short or long at a chunk's edge) shows.
PENALISED = SamplingConfig(temperature=0.8, repetition_penalty=1.5, top_k=4, prompt_logprobs=TOP)
PLAIN = SamplingConfig(temperature=1.0, prompt_logprobs=TOP)


class FlatLM:
    """A `CausalLM` of uniform logits over a large vocabulary that records the rows of every
    logits block it returns: what a scorer holds at once, without a real model's cost."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset({0})
        self.context_length = None
        self.blocks: list[int] = []

    def new_cache(self) -> ToyCache:
        return ToyCache()

    def forward(self, tokens: torch.Tensor, cache: ToyCache, num_logits: int) -> torch.Tensor:
        self.blocks.append(num_logits)
        return torch.zeros(tokens.shape[0], num_logits, self.vocab_size)


@pytest.mark.parametrize("length", [1500, 3000])
def test_the_logits_held_at_once_are_bounded_whatever_the_prompt_length(length):
    """At a 16k vocabulary one pass over 3,000 tokens is 197 MB of float32 logits (and the law's
    copies of them); scoring holds at most SCORE_BYTES of logits at a time, the same for both
    lengths, and still scores every token. One pass over the prompt fails it."""
    model = FlatLM(16_384)
    prompt = [(7 * t) % 16_384 for t in range(length)]
    scores = score_prompt(model, prompt, PLAIN, top=1)
    assert len(scores) == length
    assert scores.chosen[-1] == pytest.approx(-math.log(16_384))
    assert max(model.blocks) * model.vocab_size * 4 <= SCORE_BYTES
    assert max(model.blocks) == score_chunk(model) < length - 1
    assert sum(model.blocks) == length - 1  # the last token predicts nothing in the prompt


def test_the_chunk_keeps_its_logits_under_the_byte_bound():
    """As many positions as fit the bound in float32 logits: a bound read as one byte a logit
    holds four times too many."""
    for vocab in (64, 16_384, 151_936, SCORE_BYTES // 4, 4 * SCORE_BYTES):
        chunk = score_chunk(FlatLM(vocab))
        assert chunk >= 1
        assert chunk * vocab * 4 <= SCORE_BYTES or chunk == 1
        assert (chunk + 1) * vocab * 4 > SCORE_BYTES  # no smaller than the bound asks


def oracle(target, prompt: list[int], cfg: SamplingConfig) -> tuple[list[float], list[list]]:
    """log p'(x_t | x_<t) for t >= 1 and the law's top ids, one prefix at a time from the toy
    model's own table (no forward pass, no scorer)."""
    chosen, top = [], []
    for t in range(1, len(prompt)):
        logits = target.logits(tuple(prompt[:t])).double()[None, None]
        law = sampling.law(logits, cfg, cfg.temperature, [torch.tensor([prompt[:t]])], len(prompt))
        chosen.append(float(law[0, 0, prompt[t]]))
        top.append(law[0, 0].topk(TOP).indices.tolist())
    return chosen, top


@pytest.mark.parametrize("cfg", [PENALISED, PLAIN], ids=["penalised", "plain"])
def test_chunked_scores_are_bit_identical_to_one_pass_and_match_the_oracle(cfg):
    """A block whose law sees only its own tokens, not the blocks before it, differs under
    penalties; a block fed to a fresh cache differs everywhere."""
    target = random_lm(8, seed=5, scale=2.0)
    prompt = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 7, 2, 7, 1]
    whole = score_prompt_whole(target, prompt, cfg, TOP)
    want_chosen, want_top = oracle(target, prompt, cfg)
    assert math.isnan(whole.chosen[0]) and whole.top[0] == []
    torch.testing.assert_close(torch.tensor(whole.chosen[1:]), torch.tensor(want_chosen))
    assert [[i for i, _ in top] for top in whole.top[1:]] == want_top
    for chunk in (1, 2, 3, 5, len(prompt) - 1, 100):
        chunked = score_prompt(target, prompt, cfg, TOP, chunk=chunk)
        assert chunked.top == whole.top, chunk
        assert chunked.chosen[1:] == whole.chosen[1:], chunk


def test_a_native_model_scores_in_chunks_as_in_one_pass(tiny_llama_folder):
    """On a real (tiny) transformer the chunks run through the KV cache: attention over a
    different split of the same positions, equal to one pass within float32 rounding (1e-5 on
    log-probabilities of order 1). Its cache's pages all come back."""
    from smcspec import LLM

    folder = str(tiny_llama_folder)
    target = LLM(folder, folder, backend="native", dtype="float32").target
    prompt = [(11 * t + 3) % 60 + 3 for t in range(50)]
    whole = score_prompt_whole(target, prompt, PENALISED, TOP)
    for chunk in (1, 7, 16):
        chunked = score_prompt(target, prompt, PENALISED, TOP, chunk=chunk)
        torch.testing.assert_close(
            torch.tensor(chunked.chosen[1:]), torch.tensor(whole.chosen[1:]), atol=1e-5, rtol=0
        )
        assert [[i for i, _ in t] for t in chunked.top] == [[i for i, _ in t] for t in whole.top]
    assert target.pages.used_pages == 0


def test_a_chunk_below_one_is_refused():
    with pytest.raises(ValueError, match="chunk"):
        score_prompt(random_lm(4, seed=0), [1, 2, 3], PLAIN, TOP, chunk=0)

"""The text a caller gets is the decode of the tokens it gets, cut before the first stop string,
for every method, streamed and not, with particles that disagree: smc streams only what every
particle shares, so text taken from any one particle but the returned one shows here. The
oracle is the tokenizer's own decode, not the engine's text code."""

import pytest

from smcspec import LLM
from tests.plumbing import check_text, returned_is_not_the_first

PROMPT = "w1 w2"
SETTINGS = {
    "ar": {},
    "sd": {"draft_tokens": 3},
    "smc": {"particles": 4, "draft_tokens": 2},
}
SEEDS = range(4)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_folder, tiny_llama_draft_folder):
    return LLM(
        str(tiny_llama_folder), str(tiny_llama_draft_folder), backend="native", dtype="float32"
    )


def stop_within(text: str) -> list[str]:
    """A stop string the text holds (its third word, space included), and one it cannot."""
    words = text.split()
    return [" " + words[2], "never"] if len(words) > 2 else ["never"]


@pytest.mark.parametrize("method", list(SETTINGS))
def test_text_is_the_decode_of_the_tokens_streamed_or_not(tiny_llm, method):
    def decode(ids: list[int]) -> str:
        return tiny_llm.tokenizer.decode(ids, skip_special_tokens=True)

    settings = {"max_new_tokens": 12, "temperature": 1.0, **SETTINGS[method]}
    stopped, chosen_not_first = 0, 0
    for seed in SEEDS:
        free = tiny_llm.generate(PROMPT, method, seed=seed, chat=False, **settings)
        check_text(decode, free.text, free.token_ids, ())
        stops = stop_within(free.text)
        whole = tiny_llm.generate(PROMPT, method, seed=seed, chat=False, stop=stops, **settings)
        deltas: list[str] = []
        request = tiny_llm.request(PROMPT, method, seed=seed, chat=False, stop=stops, **settings)
        streamed = tiny_llm.run(request, on_text=deltas.append)
        assert "".join(deltas) == streamed.text == whole.text
        assert streamed.token_ids == whole.token_ids
        stopped += check_text(decode, whole.text, whole.token_ids, stops)
        for out in (free, whole):
            chosen_not_first += returned_is_not_the_first(out)
    assert stopped >= 1, "a stop string must end some decode"
    assert method != "smc" or chosen_not_first >= 2, "the returned particle must not be the first"

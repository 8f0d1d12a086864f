"""`Reward`'s memo of prefix rewards, field by field: its key is the prefix cut to the last
multiple of `every` tokens, so each token inside the cut changes it (the reward is called
again), a token past the cut does not, and a final reward is never read from it."""

import pytest

from smcspec.potentials import Reward

TOKENS = [5, 6, 7, 8, 9, 10, 11]  # every = 3: the cut is the first 6


def _counting():
    calls = []

    def fn(tokens, final):
        calls.append((tuple(tokens), final))
        return sum(tokens) + (100 if final else 0)

    return fn, calls


@pytest.mark.parametrize("position", range(len(TOKENS)))
def test_the_reward_memo_is_keyed_by_each_token_inside_the_cut_and_nothing_else(position):
    fn, calls = _counting()
    reward = Reward(fn, beta=0.5, every=3)
    first = reward.log_value(TOKENS, False)
    assert first == 0.5 * sum(TOKENS[:6]) and calls == [(tuple(TOKENS[:6]), False)]
    changed = [*TOKENS]
    changed[position] += 1
    value = reward.log_value(changed, False)
    inside = position < 6
    assert len(calls) == 1 + inside
    assert value == 0.5 * sum(changed[:6])
    # a final reward is the whole text's, never the memo's prefix value
    assert reward.log_value(TOKENS, True) == 0.5 * (sum(TOKENS) + 100)

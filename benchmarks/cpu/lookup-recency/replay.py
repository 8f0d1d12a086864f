"""How well LookupTally at each half-life predicts what lookup rounds keep, offline, on replies
exact methods committed in earlier runs (their speed.jsonl): no model runs, the tokenizer only
rebuilds the prompts. Along each reply, every 3rd position t (about a round's stride) with the
tally fed the text before t: the error of its estimate `drafts_kept(8)` against the mean of
min(match, 8) that lookup rounds from the next W positions keep (auto chooses again every 4
rounds: W = 16 is about that many tokens; W = 1 is the next round alone). Prints the mean
squared error per half-life (None: every position alike, as before).

    .venv/bin/python benchmarks/cpu/lookup-recency/replay.py W FILE.jsonl ...
"""

import json
import sys

from smcspec import LLM
from smcspec.bench.speed import prompt_ids
from smcspec.decoding.lookup import LookupTally, continuation

K = 8
HALF_LIVES = [None, 128, 64, 32, 16, 8, 4, 2]


def kept(tokens: list[int], t: int) -> int:
    """min(match, K) of the lookup's proposal at position t against the text there."""
    proposed, m = continuation(tokens[:t], K), 0
    while m < len(proposed) and t + m < len(tokens) and proposed[m] == tokens[t + m]:
        m += 1
    return m


def main() -> None:
    window, files = int(sys.argv[1]), sys.argv[2:]
    llm = LLM(dtype="int8")
    texts = []
    for f in files:
        with open(f) as lines:
            rows = [json.loads(line) for line in lines]
        plan = rows[0]["plan"]
        prompts = prompt_ids(llm, plan["prompts"], plan.get("prompt_set", "humaneval"))
        texts += [(prompts[r["prompt"]], r["token_ids"]) for r in rows[1:]]
    errors = {h: [] for h in HALF_LIVES}
    for prompt, reply in texts:
        tokens = prompt + reply
        for h in HALF_LIVES:
            tally = LookupTally(start=len(prompt), most=K, half_life=h)
            for t in range(len(prompt) + 8, len(tokens) - K - window, 3):
                tally.update(tokens[:t])
                future = sum(kept(tokens, t + i) for i in range(window)) / window
                errors[h].append((tally.drafts_kept(K) - future) ** 2)
    print(f"{len(texts)} replies, W = {window}, {len(errors[None])} positions each")
    for h in HALF_LIVES:
        print(f"half-life {h}: mean squared error {sum(errors[h]) / len(errors[h]):.3f}")


main()

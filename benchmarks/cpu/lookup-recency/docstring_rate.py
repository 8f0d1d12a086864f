"""How often the reply to HumanEval prompt P copies the docstring ('\"\"\"' within its first 48
tokens), per method, over seeds 1000..1000 + n - 1, T = 0.7: exact methods must agree up to
sampling noise. Output of `docstring_rate.py 8 30` in docstring.txt.

    .venv/bin/python benchmarks/cpu/lookup-recency/docstring_rate.py P N
"""

import sys

from smcspec import LLM
from smcspec.bench.speed import prompt_ids

SETTINGS = {
    "ar": {"method": "ar"},
    "auto": {"method": "auto"},
    "sd K=8": {"method": "sd", "draft_tokens": 8},
    "sd K=8 lookup": {"method": "sd", "proposal": "lookup", "draft_tokens": 8},
}


def main() -> None:
    p, n = int(sys.argv[1]), int(sys.argv[2])
    llm = LLM(dtype="int8")
    prompt = prompt_ids(llm, p + 1)[p]
    for name, settings in SETTINGS.items():
        hits = sum(
            '"""'
            in llm.generate(
                prompt, temperature=0.7, max_new_tokens=48, seed=1000 + s, **settings
            ).text
            for s in range(n)
        )
        print(f"{name}: prompt {p}, docstring in {hits} of {n}", flush=True)


main()

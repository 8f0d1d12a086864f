"""Where an ar / sd / smc decode's time goes on the default pair: the method's own stage split,
then torch's profiler table of one 64-token decode (the first HumanEval prompt as a chat).

    .venv/bin/python scripts/profile_round.py [ar] [sd4] [smc2x8] [smc4x4]
"""

import sys

from torch.profiler import ProfilerActivity, profile

from smcspec import LLM
from smcspec.bench.prompts import chat_text, humaneval_problems

CASES = {
    "ar": ("ar", {}),
    "sd4": ("sd", {"draft_tokens": 4}),
    "smc2x8": ("smc", {"particles": 2, "draft_tokens": 8}),
    "smc4x4": ("smc", {"particles": 4, "draft_tokens": 4}),
}


def main(names: list[str]) -> None:
    llm = LLM()
    ids = llm.encode(chat_text(humaneval_problems(0, 1)[0]), chat=True)
    for name in names or list(CASES):
        method, settings = CASES[name]
        llm.generate(ids, method, max_new_tokens=8, seed=0, chat=False, **settings)  # warm-up
        d = llm.generate(ids, method, max_new_tokens=64, seed=1, chat=False, **settings).diagnostics
        split = ", ".join(f"{k} {v:.2f}" for k, v in d["time_split"].items())
        print(f"== {name}: {d['tokens_per_second']:.2f} tok/s, {d['seconds']:.2f} s, {split}")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(ids, method, max_new_tokens=64, seed=1, chat=False, **settings)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22)
        print(table)


if __name__ == "__main__":
    main(sys.argv[1:])

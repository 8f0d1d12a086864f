"""Side-by-side tokens/s of ar, sd and smc on the default pair, interleaved, in one process.

A stop-gap until `smcspec bench speed` exists. Usage: python scripts/measure_methods.py [REPS]
"""

import statistics
import sys

import torch

from smcspec import LLM

PROMPT = "Write a Python function that checks if a number is prime."
CONFIGS = [
    ("ar", {}),
    ("sd", {"draft_tokens": 4}),
    ("smc", {"particles": 4, "draft_tokens": 2}),
    ("smc", {"particles": 8, "draft_tokens": 4}),
]


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    llm = LLM()
    rows: dict[int, list[dict]] = {i: [] for i in range(len(CONFIGS))}
    for seed in range(reps):
        for i, (method, kw) in enumerate(CONFIGS):
            out = llm.generate(
                PROMPT,
                method,
                temperature=0.7,
                max_new_tokens=64,
                stop_at_eos=False,
                seed=seed,
                **kw,
            )
            rows[i].append(out.diagnostics)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, fp32, 64 new tokens, "
        f"T=0.7, {reps} seeds"
    )
    base = statistics.median(d["tokens_per_second"] for d in rows[0])
    for i, (method, kw) in enumerate(CONFIGS):
        tps = [d["tokens_per_second"] for d in rows[i]]
        extra = ""
        if method == "sd":
            extra = f"acceptance {statistics.mean(d['acceptance_rate'] for d in rows[i]):.2f}"
        if method == "smc":
            ess = [e for d in rows[i] for e in d["ess"]]
            res = sum(d["resamples"] for d in rows[i]) / sum(d["rounds"] for d in rows[i])
            extra = f"mean ESS {statistics.mean(ess):.2f}, resample rate {res:.2f}"
        print(
            f"| {method} {kw} | {statistics.median(tps):.2f} | {min(tps):.2f}-{max(tps):.2f} | "
            f"{statistics.median(tps) / base:.2f}x | {extra} |"
        )


if __name__ == "__main__":
    main()

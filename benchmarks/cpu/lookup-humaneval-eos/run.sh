#!/usr/bin/env bash
# Which exact setting wins on code when each reply ends at its EOS: ar, sd with the draft model
# (K = 4), sd with lookup drafts (K = 4, 8) and auto, HumanEval's first 5 prompts, T = 0.7,
# alone on the machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/smcspec bench speed --methods ar sd sd-lookup auto --sd-k 4,8 --prompts 5 \
    --max-new-tokens 256 --natural-stop --temperatures 0.7 --dtype int8 \
    --out benchmarks/cpu/lookup-humaneval-eos

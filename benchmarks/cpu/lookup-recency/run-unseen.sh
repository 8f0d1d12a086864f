#!/usr/bin/env bash
# auto after the recency-weighted tally beside the fixed settings on HumanEval's first 12
# prompts, of which 5-11 played no part in choosing the half-life (replay.py read replies to
# 0-4 and copy-edit's), replies ending at EOS, T = 0.7, alone on the machine. One draw per
# prompt (humaneval-12/), then four (humaneval-12x4/: seeds differ per repetition) against the
# best fixed setting only, since one draw's length (a docstring copied or not) moves a
# prompt's tok/s more than the setting does.
set -euo pipefail
cd "$(dirname "$0")/../../.."
COMMON="--sd-k 8 --prompts 12 --max-new-tokens 256 --natural-stop --temperatures 0.7 --dtype int8"
.venv/bin/smcspec bench speed --methods sd sd-lookup auto $COMMON \
    --out benchmarks/cpu/lookup-recency/humaneval-12
.venv/bin/smcspec bench speed --methods sd-lookup auto --reps 4 $COMMON \
    --out benchmarks/cpu/lookup-recency/humaneval-12x4

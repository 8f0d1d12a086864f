#!/usr/bin/env bash
# msd's token walk against its block rule, beside sd's two rules: K = 4, N = 2 and 4, HumanEval
# prompts 0-4, three temperatures, int8 on smcspec's kernel (AMX on a Xeon), alone on the machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/smcspec bench speed --methods sd sd-block msd msd-block --sd-k 4 --msd-n 2,4 \
    --msd-k 4 --prompt-set humaneval --prompts 5 --temperatures 0.7,1.0,1.5 \
    --max-new-tokens 128 --dtype int8 --out benchmarks/cpu/msd-block

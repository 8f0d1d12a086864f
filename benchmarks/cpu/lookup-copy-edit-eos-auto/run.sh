#!/usr/bin/env bash
# auto after it weighs prompt lookup sooner (open positions in the tally; a choice the round the
# text first prices lookup), beside ar and sd with lookup drafts, on the 20 copy-edit requests
# ending at EOS, T = 0.7, alone on the machine (lookup-copy-edit-eos has auto before the change).
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/smcspec bench speed --methods ar sd-lookup auto --sd-k 4,8 \
    --prompt-set copy-edit --prompts 20 --temperatures 0.7 --max-new-tokens 256 --natural-stop \
    --dtype int8 --out benchmarks/cpu/lookup-copy-edit-eos-auto

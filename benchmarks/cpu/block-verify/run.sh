#!/usr/bin/env bash
# sd's token rule against block verification, K = 4, HumanEval prompts 0-4, three temperatures.
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/smcspec bench speed --methods sd sd-block --sd-k 4 --prompt-set humaneval --prompts 5 \
    --temperatures 0.7,1.0,1.5 --max-new-tokens 128 --dtype int8 --out benchmarks/cpu/block-verify

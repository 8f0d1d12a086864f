#!/usr/bin/env bash
# Prompt lookup on the copy-edit set (its first 5 requests), beside ar, sd, sd block and auto.
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/smcspec bench speed --methods ar sd sd-block sd-lookup sd-lookup-draft auto --sd-k 4 \
    --prompt-set copy-edit --prompts 5 --temperatures 0.7 --max-new-tokens 128 --dtype int8 \
    --out benchmarks/cpu/lookup-copy-edit

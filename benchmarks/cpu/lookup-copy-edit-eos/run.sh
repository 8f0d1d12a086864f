#!/usr/bin/env bash
# Prompt lookup on all 20 copy-edit requests, each reply ending at its EOS (--natural-stop) as a
# user's would: the earlier copy-edit runs ignored EOS for 128 tokens, so their replies went on
# past the edited text into text the request does not hold. ar, sd (draft model), sd with lookup
# drafts and with lookup-else-draft, K = 4 and 8, and auto, at T = 0.7, alone on the machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/smcspec bench speed --methods ar sd sd-lookup sd-lookup-draft auto --sd-k 4,8 \
    --prompt-set copy-edit --prompts 20 --temperatures 0.7 --max-new-tokens 256 --natural-stop \
    --dtype int8 --out benchmarks/cpu/lookup-copy-edit-eos

#!/usr/bin/env bash
# The README's speed table on AMX (smcspec's kernel picks AMX tiles from 8-16 rows on a Xeon
# that grants them): bench engine in int8, then int4, one after the other, alone on the machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
for dtype in int8 int4; do
    .venv/bin/smcspec bench engine --dtype "$dtype" --backends native --methods ar sd smc \
        --sd-k 4,6 --smc-n 2,4,8 --smc-k 4,8 --prompts 3 --max-new-tokens 128 \
        --out "benchmarks/cpu/engine-xeon-amx-$dtype"
done

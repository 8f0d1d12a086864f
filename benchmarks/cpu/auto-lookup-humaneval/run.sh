#!/usr/bin/env bash
# auto on HumanEval prompts before (c2456e3, a second work tree at $BEFORE) and after it weighs
# prompt lookup sooner, interleaved twice, alone on the machine: code that does not copy its
# prompt must not pay for the earlier look. Each reply ends at its EOS; eos-ignored/ holds the
# same runs at 128 tokens with EOS ignored (NATURAL= TOKENS=128 SUB=eos-ignored), where the text
# past the answer repeats itself and lookup copies it.
set -euo pipefail
cd "$(dirname "$0")/../../.."
NATURAL=${NATURAL---natural-stop}
ARGS="bench speed --methods ar auto --prompts 5 --max-new-tokens ${TOKENS:-256} $NATURAL --temperatures 0.7 --dtype int8"
scripts/bench_before_after "benchmarks/cpu/auto-lookup-humaneval/${SUB:-.}" $ARGS

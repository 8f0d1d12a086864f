#!/usr/bin/env bash
# The benchmark runs quoted in the README, in order, on the default pair. Resumable: rerun to
# finish an interrupted run. Usage: scripts/run_benchmarks.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/cpu}
bin=.venv/bin
# Steps 1-4 are the smcspec 0.1 tables: the fp32 transformers path, next to HF's own generate.
fp32=(--backend hf --dtype float32)
# 1. speed: every method, 5 prompts, 64 tokens (EOS ignored), T = 0.7
$bin/smcspec bench speed "${fp32[@]}" --methods ar sd smc hf hf-assisted --sd-k 2,4 \
  --smc-n 2,4,8 --smc-k 2,4 --prompts 5 --max-new-tokens 64 --temperatures 0.7 --out "$out/speed"
# the best smc setting of step 1 drives the sweep and the accuracy run
best=$($bin/python - "$out/speed/speed.jsonl" <<'PY'
import sys
from smcspec.bench import report
from smcspec.bench.results import measurements
rows = [r for r in report.speed_summary(measurements(sys.argv[1])) if r["label"].startswith("smc")]
best = max(rows, key=lambda r: r["median_tps"])["label"].split()
print(best[1][2:], best[2][2:])
PY
)
read -r n k <<< "$best"
echo "best smc: N=$n K=$k"
# 2. temperature sweep: ar, sd K=4 and the best smc
$bin/smcspec bench speed "${fp32[@]}" --methods ar sd smc --sd-k 4 --smc-n "$n" --smc-k "$k" --prompts 3 \
  --max-new-tokens 64 --temperatures 0.3,0.7,1.0,1.3 --out "$out/sweep"
# 3. accuracy: HumanEval problems 0..19, ar, sd K=4, best smc
$bin/smcspec bench accuracy "${fp32[@]}" --methods ar sd smc --sd-k 4 --smc-n "$n" --smc-k "$k" \
  --limit 20 --max-new-tokens 384 --temperature 0.7 --out "$out/accuracy"
# 4. roofline against the measured speed-ups of step 1
$bin/smcspec bench roofline "${fp32[@]}" --smc-n 2,4,8 --smc-k 2,4 --speed-results "$out/speed/speed.jsonl" \
  --out "$out/roofline"
# 5. the engines side by side at int8 (native vs transformers), and 6. what int8 costs
$bin/smcspec bench engine --dtype int8 --backends native,hf --sd-k 4,6 --smc-n 2,4 --smc-k 4,8 \
  --prompts 3 --max-new-tokens 128 --out "$out/engine-int8"
$bin/smcspec bench fidelity --dtype int8 --out "$out/fidelity-int8"
# 7. potentials: HumanEval pass@1 with power sampling, and 8. constrained JSON
$bin/smcspec bench accuracy --methods ar smc --smc-n 4 --smc-k 4 --smc-power 2,4 --limit 20 \
  --max-new-tokens 384 --temperature 0.7 --out "$out/accuracy-power"
$bin/smcspec bench json --particles 4 -k 4 --reps 2 --max-new-tokens 96 --out "$out/json"
# 9. the server under 1, 4 and 16 concurrent clients against the same requests one at a time
$bin/smcspec bench serve --concurrency 1,4,16 --requests 16 --max-tokens 32 --out "$out/serve"
# 10. does what each method returns follow the target's law? GSM8K prompts, every token rescored
law=($bin/smcspec bench law --task gsm8k --dtype int8 --max-new-tokens 128 --batch 4 --out "$out/law")
"${law[@]}" --methods ar sd --sd-k 4 --problems 0:96
"${law[@]}" --methods smc --smc-n 2 --smc-k 8 --problems 0:32

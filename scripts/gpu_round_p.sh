#!/usr/bin/env bash
# GPU round P (issue 7), for the next session: the figures round O left open, on the 48-layer
# preset, b1 unless said:
#   1. prefetch depth 3 (guesses three layers ahead: does the copy queue stop draining?)
#   2. offload at b4 without gates (against round O's gated 135.1 tok/s)
#   3. scripts/bench_stop_phases.py without gates (round O has the gated half)
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
B="python3 -m ft bench decode --model /tmp/q30 --tokens 16 --warmup 3 $P --json --moe-cache-rate 0.15"
{
date -u
timeout 150 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -1
timeout 120 $B --strategies offload --batch 1 --moe-prefetch-depth 3 > $OUT/p-depth3.json 2>/dev/null
echo "== depth 3"; show $OUT/p-depth3.json
timeout 150 $B --strategies offload --batch 4 > $OUT/p-b4.json 2>/dev/null
echo "== b4, no gates"; show $OUT/p-b4.json
timeout 150 python3 scripts/bench_stop_phases.py --model /tmp/q30 --gates off --tokens 32 \
  2>/dev/null | tee $OUT/p-phases.jsonl
date -u
} 2>&1 | tee $OUT/round_p.log

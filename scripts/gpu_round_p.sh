#!/usr/bin/env bash
# GPU round P (issue 7): the figures round O left open, on the 48-layer preset, without gates:
#   1. prefetch depth 2, 3 and 4 at b1 and b4 (do guesses further ahead keep the copy queue
#      from draining?)
#   2. scripts/bench_stop_phases.py without gates (round O has the gated half)
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
B="python3 -m ft bench decode --model /tmp/q30 --tokens 16 --warmup 3 $P --json --moe-cache-rate 0.15"
{
date -u
timeout 150 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -1
for d in 2 3 4; do
  timeout 130 $B --strategies offload --batch 1,4 --moe-prefetch-depth $d > $OUT/p-depth$d.json 2>$OUT/p-depth$d.err
  echo "== depth $d (rc $?) $(date -u +%T)"; show $OUT/p-depth$d.json; tail -1 $OUT/p-depth$d.err
done
timeout 110 python3 scripts/bench_stop_phases.py --model /tmp/q30 --gates off --tokens 32 \
  2>/dev/null | tee $OUT/p-phases.jsonl
date -u
} 2>&1 | tee $OUT/round_p.log

#!/usr/bin/env bash
# GPU round AM, fourth call: the code as it lands (`--moe-gates`): the GPU tests of zero-copy
# and gates, then host stops against gates (window 2) in one process on one load.
set -u
source scripts/gpu_env.sh
{
date -u
timeout 90 python3 -m pytest -q -m gpu tests/engine/test_zero_copy.py 2>&1 | tail -3
date -u
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; synth_q30; }
date -u
timeout $((340 - SECONDS)) python3 scripts/bench_sweep.py --model /tmp/q30 --strategy offload \
  --batch 1,4 --repeats 2 --tokens 32 --warmup 4 --cache-rate 0.15 $P \
  --variants "stop:;gates:GATES=1" 2>$OUT/am4_sweep.err | tee $OUT/am4_sweep.jsonl
date -u
} 2>&1 | tee $OUT/round_am4.log

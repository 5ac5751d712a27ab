#!/usr/bin/env bash
# GPU round AJ (issue 7): the GPU tests of the code as it lands (round AI's run of them was cut
# by its timeout), then offload's host stops against zero-copy decode (window 8) at the issue's
# cache rate, both with the lean stretch (scripts/bench_sweep.py, one load of the experts).
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
{
date -u
timeout 260 python3 -m pytest -q -m gpu tests/engine 2>&1 | tail -6
[ -f /tmp/q30/config.json ] || synth_q30
date -u
timeout $((590 - SECONDS)) python3 scripts/bench_sweep.py --model /tmp/q30 --tokens 32 $P \
  --batch 1,4 --repeats 2 --variants "stop:;zc8:ZC=1,WINDOW=8" 2>$OUT/aj.err | tee $OUT/aj.jsonl
date -u
} 2>&1 | tee $OUT/round_aj.log

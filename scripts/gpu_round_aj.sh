#!/usr/bin/env bash
# GPU round AJ (issue 7): the GPU tests of the code as it lands (round AI's run of them was cut
# by its timeout), then offload's host stops against zero-copy decode (window 8) at the issue's
# cache rate, both with the lean stretch, on the preset cut to 8 layers (what the session's last
# minutes of device time allowed; scripts/bench_sweep.py, one load of the experts).
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
{
date -u
timeout 220 python3 -m pytest -q -m gpu tests/engine 2>&1 | tail -6
date -u
timeout 60 python3 -m ft model synth --preset qwen3-30b-a3b --layers 8 --out /tmp/q30-8 2>&1 | tail -1
timeout $((400 - SECONDS)) python3 scripts/bench_sweep.py --model /tmp/q30-8 --tokens 32 $P \
  --batch 1,4 --repeats 2 --variants "stop:;zc8:ZC=1,WINDOW=8" 2>$OUT/aj.err | tee $OUT/aj.jsonl
date -u
} 2>&1 | tee $OUT/round_aj.log

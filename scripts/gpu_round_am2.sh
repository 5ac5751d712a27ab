#!/usr/bin/env bash
# GPU round AM, second call: misses copied at the gate with a wide window (zcc8: is round AM's
# collapse the window's?) and the gate shut at every layer until the host has followed it
# (FT_ZERO_COPY_MISSES=gate: the GPU never runs ahead of the host), against host stops.
# (FT_ZERO_COPY_MISSES was the round's switch, since removed: `--moe-gates` is what landed.)
set -u
source scripts/gpu_env.sh
{
date -u
timeout 150 python3 -m pytest -q -m gpu tests/engine/test_zero_copy.py 2>&1 | tail -3
date -u
pkill -f "python3 -m [f]t model" && sleep 3
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; df -h / | tail -1; synth_q30; }
date -u
timeout $((585 - SECONDS)) python3 scripts/bench_sweep.py --model /tmp/q30 --strategy offload \
  --batch 1,4 --repeats 2 --tokens 32 --warmup 4 --cache-rate 0.15 $P \
  --variants "stop:;zcg2:ZC=1,WINDOW=2,FT_ZERO_COPY_MISSES=gate;zcc8:ZC=1,WINDOW=8,FT_ZERO_COPY_MISSES=copy;zcg4:ZC=1,WINDOW=4,FT_ZERO_COPY_MISSES=gate" \
  2>$OUT/am2_sweep.err | tee $OUT/am2_sweep.jsonl
date -u
} 2>&1 | tee $OUT/round_am2.log

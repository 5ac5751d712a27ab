#!/usr/bin/env bash
# GPU round AM (issue 7): zero-copy decode whose misses wait for their copy at the layer's gate
# (FT_ZERO_COPY_MISSES=copy, the round's switch) against misses read in place (zero-copy as it
# was) and offload's host stops, in one process on one load of the experts; the GPU tests of
# zero-copy, graphs and the fused kernels first.
# (FT_ZERO_COPY_MISSES was the round's switch, since removed: `--moe-gates` is what landed.)
set -u
source scripts/gpu_env.sh
{
date -u
timeout 240 python3 -m pytest -q -m gpu tests/engine/test_zero_copy.py tests/engine/test_graphs.py \
  tests/engine/test_fused.py 2>&1 | tail -15
date -u
pkill -f "python3 -m [f]t model" && sleep 3  # a synth left running by an earlier call
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; df -h / | tail -1; synth_q30; }
date -u
timeout $((585 - SECONDS)) python3 scripts/bench_sweep.py --model /tmp/q30 --strategy offload \
  --batch 1,4 --repeats 2 --tokens 32 --warmup 4 --cache-rate 0.15 $P \
  --variants "stop:;zcr8:ZC=1;zcc2:ZC=1,WINDOW=2,FT_ZERO_COPY_MISSES=copy;zcc4:ZC=1,WINDOW=4,FT_ZERO_COPY_MISSES=copy" \
  2>$OUT/am_sweep.err | tee $OUT/am_sweep.jsonl
date -u
} 2>&1 | tee $OUT/round_am.log

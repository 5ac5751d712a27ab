#!/usr/bin/env bash
# GPU round AA (issue 7): the prefetch window with its held guesses fed only after the next
# stretch is launched (round Z fed them in the stop's prepare too, before the launch), and where
# batch 1's step goes now.
# 1. scripts/bench_sweep.py, offload b1 and b4, window 0 and 2, three runs each, one load
# 2. scripts/bench_stop_phases.py b1, window 0 and 2: the host's microseconds per MoE layer
# 3. ft bench decode --trace, offload and hybrid b1, the new defaults: the device timeline line
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
{
date -u
synth_q30
date -u
timeout 200 python3 scripts/bench_sweep.py --model /tmp/q30 --tokens 32 $P --batch 1,4 \
  --repeats 3 --variants "w0:WINDOW=0;w2:WINDOW=2" 2>$OUT/aa.err | tee $OUT/aa.jsonl
date -u
(cd scripts && timeout 150 python3 bench_stop_phases.py --model /tmp/q30 --tokens 32 \
  --repeats 2 --variants "w0:WINDOW=0;w2:WINDOW=2") 2>$OUT/aa-phases.err | tee $OUT/aa-phases.jsonl
date -u
left=$((560 - SECONDS))
[ $left -gt 60 ] && timeout $left python3 -m ft bench decode --model /tmp/q30 \
  --strategies offload,hybrid --moe-cache-rate 0.15 --batch 1 --tokens 32 --warmup 4 $P \
  --trace /tmp/aa-trace --out $OUT/aa-bench.json 2>$OUT/aa-bench.err | tail -16
date -u
} 2>&1 | tee $OUT/round_aa.log

#!/usr/bin/env bash
# GPU round L (issue 7), short: the host's cost of one offload stop on the H200 box's CPU
# (scripts/bench_stop_host.py, after the slot table's numpy view), and the 8-layer cut's offload
# and hybrid at prefetch depth 2 against 1, after round K.
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
{
date -u
python3 scripts/bench_stop_host.py --steps 100; python3 scripts/bench_stop_host.py --steps 100 --depth 1
timeout 40 python3 -m ft model synth --preset qwen3-30b-a3b --layers 8 --out /tmp/q30-8 2>&1 | tail -1
for depth in 2 1; do
  timeout 60 python3 -m ft bench decode --model /tmp/q30-8 --tokens 16 --warmup 3 $P --json \
    --strategies offload,hybrid --moe-cache-rate 0.15 --gpu-memory-limit 4 --batch 1,4 \
    --moe-prefetch-depth $depth > $OUT/l-d8-depth$depth.json 2>/dev/null
  echo "== depth $depth"; show $OUT/l-d8-depth$depth.json
done
date -u
} 2>&1 | tee $OUT/round_l.log

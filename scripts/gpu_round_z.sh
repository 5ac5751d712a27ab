#!/usr/bin/env bash
# GPU round Z (issue 7): the prefetch window and the pinned engine thread as they landed
# (--moe-prefetch-window, default 2 for offload and none for hybrid; --pin-engine-thread, on with
# CUDA), after round Y measured them as experiments (docs/perf.md).
# 1. the GPU tests of graphs, the expert cache and hybrid, under the new defaults
# 2. scripts/bench_sweep.py on one load, b1 and b4 on each engine, three runs each, interleaved:
#    offload as before (no window, not pinned), window only, pin only, the new defaults; hybrid
#    as before (not pinned) and the new defaults
# 3. `ft bench decode` of the three strategies, the command of the targets' table, new defaults
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
T="tests/engine/test_graphs.py tests/engine/test_expert_cache.py tests/engine/test_hybrid.py"
{
date -u
synth_q30 > /tmp/synth.log 2>&1 &
timeout 150 python3 -m pytest -q -m gpu -o timeout=100 $T 2>&1 | tail -4
wait; cat /tmp/synth.log; date -u
V="old:WINDOW=0,PIN=0;window:WINDOW=2,PIN=0;pin:WINDOW=0,PIN=1;new:"
V="$V;h-old:STRATEGY=hybrid,PIN=0;h-new:STRATEGY=hybrid"
timeout 280 python3 scripts/bench_sweep.py --model /tmp/q30 --tokens 32 $P --batch 1,4 \
  --repeats 3 --variants "$V" 2>$OUT/z.err | tee $OUT/z.jsonl
date -u
left=$((575 - SECONDS))
[ $left -gt 60 ] && timeout $left python3 -m ft bench decode --model /tmp/q30 \
  --strategies resident,offload,hybrid --moe-cache-rate 0.15 --batch 1,4 --tokens 32 --warmup 4 \
  $P --out $OUT/z-bench.json 2>$OUT/z-bench.err | tail -20
date -u
} 2>&1 | tee $OUT/round_z.log

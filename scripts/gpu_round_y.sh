#!/usr/bin/env bash
# The switches this round used were the experiment's: FT_PREFETCH_WINDOW (cache.py) landed as
# --moe-prefetch-window, PIN_CPU (bench_sweep.py: the main thread pinned around a run) as the
# engine's --pin-engine-thread; bench_sweep.py's pseudo-variables are WINDOW= and PIN= now.
# GPU round Y (issue 7): round W's prefetch window (FT_PREFETCH_WINDOW=N: at most N prefetched
# experts queued on the copy engine, the rest held on the host and queued at later stops, nearest
# layer first), confirmed on a second load, with hybrid and a pinned main thread beside it.
# Round W, one process, three runs: b4 with a window of 2 decoded 160.7-166.5 tok/s against
# 136.8-150.6 without (122 experts copied a step against 137); at b1 no variant led clearly.
# scripts/bench_sweep.py on one load, b1 and b4 on each engine, three runs each, interleaved:
# offload with no window, 2, 3, and none with the main thread pinned to core 15 (rounds R-V: a
# b1 run's level is set on the host's side); hybrid with no window and 2.
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
W="FT_PREFETCH_WINDOW"
{
date -u; nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node0"
synth_q30
date -u
V="off:;w2:$W=2;w3:$W=3;pin:PIN_CPU=15;h-off:STRATEGY=hybrid;h-w2:STRATEGY=hybrid,$W=2"
timeout 420 python3 scripts/bench_sweep.py --model /tmp/q30 --tokens 32 $P --batch 1,4 \
  --repeats 3 --variants "$V" 2>$OUT/y.err | tee $OUT/y.jsonl
date -u
} 2>&1 | tee $OUT/round_y.log

#!/usr/bin/env bash
# GPU round S (issue 7): the landed in-place slot table, and the batch-1 runs that come out
# ~25% slow (rounds P to R: a whole run at ~12.5 ms a step, against ~10 ms, in 5 of 12 runs of
# round R, within one process). One guess: the CUDA streams of each engine land on shared
# hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), so a copy stream can queue
# behind the compute. Five b1 runs at the default, then five with 32 queues, each its own process.
# 1. the GPU tests of graphs, the cache and hybrid
# 2. scripts/bench_sweep.py at b1, five runs, CUDA_DEVICE_MAX_CONNECTIONS unset, then 32
# 3. scripts/bench_stop_phases.py: the host's phases per layer
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
T="tests/engine/test_graphs.py tests/engine/test_expert_cache.py tests/engine/test_hybrid.py"
S="python3 scripts/bench_sweep.py --model /tmp/q30 --batch 1 --repeats 5 --tokens 32 $P"
{
date -u
timeout 150 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 > /tmp/synth.log 2>&1 &
timeout 100 python3 -m pytest -q -m gpu -o timeout=60 $T 2>&1 | tail -3
wait; tail -1 /tmp/synth.log; date -u
timeout 100 $S 2>$OUT/s-default.err | tee $OUT/s-default.jsonl; date -u
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 100 $S 2>$OUT/s-conn32.err | tee $OUT/s-conn32.jsonl
date -u
timeout 90 python3 scripts/bench_stop_phases.py --model /tmp/q30 --tokens 32 --repeats 2 \
  2>$OUT/s-phases.err | tee $OUT/s-phases.jsonl
tail -1 $OUT/s-phases.err
date -u
} 2>&1 | tee $OUT/round_s.log

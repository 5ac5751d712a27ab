#!/usr/bin/env bash
# GPU round T (issue 7): where offload's batch-1 step goes on the device, from traces, and what a
# slow run does differently. Rounds P to S had whole b1 runs at ~12.5 ms a step against ~10 ms,
# cause unmeasured; the host's phases alone cannot say whether the GPU then waits for copies or
# for the host. Every run here is traced (`ft bench decode --trace`: its device timeline) and
# logs the host's state (context switches, CPU, SM clock).
# 1. scripts/bench_sweep.py, one load: b1 six runs, b4 two, each traced
# 2. the same b1 runs with CUDA_DEVICE_MAX_CONNECTIONS=32 (round S's guess), four runs
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
S="python3 scripts/bench_sweep.py --model /tmp/q30 --tokens 32 $P"
{
date -u
synth_q30
date -u
timeout 200 $S --batch 1 --repeats 6 --trace /tmp/tr1 2>$OUT/t-b1.err | tee $OUT/t-b1.jsonl
date -u
timeout 100 $S --batch 4 --repeats 2 --trace /tmp/tr4 2>$OUT/t-b4.err | tee $OUT/t-b4.jsonl
date -u
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 130 $S --batch 1 --repeats 4 2>$OUT/t-conn32.err \
  | tee $OUT/t-conn32.jsonl
date -u
python3 scripts/compact_traces.py /tmp/compact /tmp/tr1/*/*.trace.json /tmp/tr4/*/*.trace.json
tar -cf $OUT/traces.tar -C /tmp compact && ls -la $OUT
} 2>&1 | tee $OUT/round_t.log

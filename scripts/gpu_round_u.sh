#!/usr/bin/env bash
# GPU round U (issue 7): is a slow offload b1 run slow for its process's age or its engine's?
# Rounds P to T saw a process's first runs ~25% slower than its later ones (78 against 92-99
# tok/s), the host slower in them (round T's traces), copies not. scripts/warmup_curve.py prints
# every run's step times from the process's first decode step on: three engines one after
# another, four runs each, no warm-up; a second process repeats it. Then batch 4 and hybrid b1
# at HEAD (round T's traced b4 timed out), three runs each on one load (bench_sweep.py).
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
{
date -u
synth_q30
for p in 1 2; do
  date -u
  timeout 110 python3 scripts/warmup_curve.py --model /tmp/q30 --engines 3 --runs 4 $P \
    2>$OUT/u-curve$p.err | tee $OUT/u-curve$p.jsonl
done
date -u
timeout 100 python3 scripts/bench_sweep.py --model /tmp/q30 --batch 4 --repeats 3 $P \
  2>$OUT/u-b4.err | tee $OUT/u-b4.jsonl
date -u
timeout 100 python3 scripts/bench_sweep.py --model /tmp/q30 --strategy hybrid --batch 1 \
  --repeats 3 $P 2>$OUT/u-hybrid.err | tee $OUT/u-hybrid.jsonl
date -u
} 2>&1 | tee $OUT/round_u.log

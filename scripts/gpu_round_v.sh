#!/usr/bin/env bash
# GPU round V (issue 7): are a process's slow first runs the synth's 62 GB still being written
# back? Round U: a process started right after the synth took >110 s to load the experts (the
# next one ~75 s), and its runs past the first showed no slow start. Here vmstat and the kernel's
# dirty/writeback counters are logged every 5 s while a warm-up curve runs right after the synth,
# then again after `sync`.
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
vmstat -t 5 > $OUT/v-vmstat.log 2>&1 &
(while true; do echo "$(date +%T) $(grep -E '^(Dirty|Writeback|MemFree|Cached):' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"; sleep 5; done) > $OUT/v-meminfo.log 2>&1 &
C="python3 scripts/warmup_curve.py --model /tmp/q30 --engines 1 --runs 6 $P"
{
date -u
synth_q30
date -u
timeout 200 $C 2>$OUT/v-curve1.err | tee $OUT/v-curve1.jsonl
date -u
time sync
date -u
timeout 150 $C 2>$OUT/v-curve2.err | tee $OUT/v-curve2.jsonl
date -u
} 2>&1 | tee $OUT/round_v.log
kill %1 %2

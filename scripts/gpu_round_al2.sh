#!/usr/bin/env bash
# GPU round AL, second call: `ft bench decode` at the issue's setting in its own process, then
# the stop's read once more in one process: polled pinned rows (new) against the copy back and
# sync (FT_STOP_READ=sync, a switch gone since with the polled read: level), the pair sum
# kernel in both.
set -u
source scripts/gpu_env.sh
{
date -u
[ -f /tmp/q30/config.json ] || synth_q30
date -u
timeout 300 python3 -m ft bench decode --model /tmp/q30 \
  --strategies resident,offload,hybrid --moe-cache-rate 0.15 --batch 1,4 --tokens 32 --warmup 4 \
  $P --json > $OUT/al_bench.json 2>$OUT/al_bench.err
show $OUT/al_bench.json
date -u
timeout $((585 - SECONDS)) python3 scripts/bench_stop_phases.py --model /tmp/q30 --tokens 32 \
  --batch 1,4 --repeats 2 --variants "poll:;sync:FT_STOP_READ=sync" \
  2>$OUT/al2_phases.err | tee $OUT/al2_phases.jsonl
date -u
} 2>&1 | tee $OUT/round_al2.log

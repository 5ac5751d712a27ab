#!/usr/bin/env bash
# GPU round AL (issue 7): the stretch without torch's pair sum (one Triton launch sums each
# token's expert rows and casts, where torch took four: two fills, index_add_, the cast) and the
# stop reading its ids from pinned rows the top-k writes (polled; no copy back, no sync call).
# The GPU tests of the engine's decode paths ran first (78 passed), in a call of their own;
# then in one process on one load of the experts: new, old (both switched off:
# FT_PAIR_SUM=torch, FT_STOP_READ=sync), and the sum alone. Both switches were the round's only
# and are gone since: the polled read for host stops was reverted (level), the sum stayed.
set -u
source scripts/gpu_env.sh
{
date -u
pkill -f "python3 -m [f]t model" && sleep 3  # a synth left running by an earlier call
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; df -h / | tail -1; synth_q30; }
date -u
timeout $((585 - SECONDS)) python3 scripts/bench_stop_phases.py --model /tmp/q30 --tokens 32 \
  --batch 1,4 --repeats 2 \
  --variants "new:;old:FT_PAIR_SUM=torch,FT_STOP_READ=sync;sum:FT_STOP_READ=sync" \
  2>$OUT/al_phases.err | tee $OUT/al_phases.jsonl
date -u
} 2>&1 | tee $OUT/round_al.log

#!/usr/bin/env bash
# GPU round AN, third call: the code as it lands (--moe-gates now tops up the copy engine between
# routings and lets a nearer guess replace a held one): GPU tests, copies per layer in the step
# (--by-layer), an eviction that takes late layers' slots first (FT_EVICT_LATE=N, of the N least
# recent), b4, and `ft bench decode --moe-gates`.
# (Run when host stops were offload's default; `stop` now says GATES=0 to stay host stops.
# FT_TOP_UP and FT_HELD, and FT_EVICT_LATE, were this round's switches: the first two are now
# what --moe-gates does, the last was removed.)
set -u
source scripts/gpu_env.sh
{
date -u
python3 scripts/probe_copy_engines.py | tee $OUT/an3_copy_engines.json
timeout 90 python3 -m pytest -q -m gpu tests/engine/test_zero_copy.py tests/engine/test_graphs.py 2>&1 | tail -3
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; synth_q30; }
date -u
timeout $((300 - SECONDS)) $OFFLOAD_SWEEP --batch 1 --repeats 2 --by-layer \
  --variants "stop:GATES=0;gates:GATES=1;late16:GATES=1,FT_EVICT_LATE=16;late64:GATES=1,FT_EVICT_LATE=64" \
  2>$OUT/an3_b1.err | tee $OUT/an3_b1.jsonl
date -u
timeout $((400 - SECONDS)) $OFFLOAD_SWEEP --batch 4 --repeats 2 \
  --variants "gates:GATES=1;late64:GATES=1,FT_EVICT_LATE=64" 2>$OUT/an3_b4.err | tee $OUT/an3_b4.jsonl
date -u
timeout $((560 - SECONDS)) python3 -m ft bench decode --model /tmp/q30 --strategies offload --moe-gates \
  --moe-cache-rate 0.15 --batch 1,4 --tokens 32 --warmup 4 $P --json > $OUT/an3_bench.json 2>$OUT/an3_bench.err
show $OUT/an3_bench.json
date -u
} 2>&1 | tee $OUT/round_an3.log

#!/usr/bin/env bash
# GPU round AP: the code as it lands after round AO (gates now guess the next token's first MoE
# layers at the step's end): the engine's GPU tests, the copy granularity probe (an expert as
# three parts and a ready mark, as the engine copies it, against one contiguous block), `ft bench
# decode` for the record (b1, b4), then gates against host stops in one process.
set -u
source scripts/gpu_env.sh
{
date -u
python3 scripts/probe_copy_engines.py --queued 12 | tee $OUT/ap_copy_engines.json
timeout 180 python3 -m pytest -q -m gpu tests/engine 2>&1 | tail -3
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; synth_q30; }
date -u
record_offload ap_bench 420
date -u
timeout $((560 - SECONDS)) $OFFLOAD_SWEEP --batch 1 --repeats 3 --variants "stop:GATES=0;gates:" \
  2>$OUT/ap_b1.err | tee $OUT/ap_b1.jsonl
date -u
} 2>&1 | tee $OUT/round_ap.log

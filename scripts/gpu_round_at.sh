#!/usr/bin/env bash
# GPU round AT: kept layers as offload's default (round AS: b1 +3.4%, b4 +1.4% in one process):
# `ft bench decode` for the record (b1, b4), then more kept layers (8) and a deeper guess
# (depth 3, now that the layers without a miss no longer wait for the host) in one process.
set -u
source scripts/gpu_env.sh
{
date -u
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; synth_q30; }
date -u
record_offload at_bench 300
date -u
timeout $((540 - SECONDS)) $OFFLOAD_SWEEP --batch 1 --repeats 2 \
  --variants "keep4:;keep8:FT_KEEP_AHEAD=8;keep4d3:DEPTH=3" 2>$OUT/at_b1.err | tee $OUT/at_b1.jsonl
date -u
} 2>&1 | tee $OUT/round_at.log

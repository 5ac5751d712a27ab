#!/usr/bin/env bash
# GPU round AQ: the ready marks written from the copy's stream queue (a driver stream memory
# operation, ft/engine/experts/stream_write.py) in place of a 4-byte copy behind each expert,
# which round AP's probe put at ~10 us of the link an expert: the probe again with the written
# mark, the zero-copy and graphs GPU tests, `ft bench decode` for the record, then written
# against copied marks (FT_READY_MARK=copy) in one process, b1 and b4.
set -u
source scripts/gpu_env.sh
{
date -u
python3 scripts/probe_copy_engines.py --queued 12 | tee $OUT/aq_copy_engines.json
timeout 100 python3 -m pytest -q -m gpu tests/engine/test_zero_copy.py tests/engine/test_graphs.py -rs 2>&1 | tail -4
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; synth_q30; }
date -u
record_offload aq_bench 330
date -u
timeout $((450 - SECONDS)) $OFFLOAD_SWEEP --batch 1 --repeats 2 --variants "copied:FT_READY_MARK=copy;written:" \
  2>$OUT/aq_b1.err | tee $OUT/aq_b1.jsonl
date -u
timeout $((540 - SECONDS)) $OFFLOAD_SWEEP --batch 4 --repeats 1 --variants "copied:FT_READY_MARK=copy;written:" \
  2>$OUT/aq_b4.err | tee $OUT/aq_b4.jsonl
date -u
} 2>&1 | tee $OUT/round_aq.log

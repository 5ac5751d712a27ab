#!/usr/bin/env bash
# GPU round AS: kept layers (device gates pass a layer without waiting for the host where the
# host keeps its slots and every routed expert has one, FT_KEEP_AHEAD; 0 = each layer waits
# for its gate, as before). Every GPU test of the engine first (round AR's block layout was
# cut short there; resident now copies its banks as blocks), then kept layers against gates
# at every layer in one process, b1 then b4.
set -u
source scripts/gpu_env.sh
{
date -u
timeout 200 python3 -m pytest -q -m gpu tests/engine -rs 2>&1 | tail -6
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; synth_q30; }
date -u
timeout $((470 - SECONDS)) $OFFLOAD_SWEEP --batch 1 --repeats 2 --variants "gate:FT_KEEP_AHEAD=0;keep4:" \
  2>$OUT/as_b1.err | tee $OUT/as_b1.jsonl
date -u
timeout $((585 - SECONDS)) $OFFLOAD_SWEEP --batch 4 --repeats 1 --variants "gate:FT_KEEP_AHEAD=0;keep4:" \
  2>$OUT/as_b4.err | tee $OUT/as_b4.jsonl
date -u
} 2>&1 | tee $OUT/round_as.log

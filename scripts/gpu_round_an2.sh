#!/usr/bin/env bash
# GPU round AN, second call: with device gates, the copy engine fed between routings (FT_TOP_UP=1)
# and a nearer guess replacing a held one (FT_HELD=replace), do deeper guesses (DEPTH 3, 4) fill
# the link's idle time at b1? Then traces of where PCIe idles (gates, replace_d3), and b4.
# (Run when host stops were offload's default; `stop` now says GATES=0 to stay host stops.
# FT_TOP_UP and FT_HELD, and FT_EVICT_LATE, were this round's switches: the first two are now
# what --moe-gates does, the last was removed.)
set -u
source scripts/gpu_env.sh
R="GATES=1,FT_TOP_UP=1,FT_HELD=replace"
{
date -u
python3 scripts/probe_copy_engines.py | tee $OUT/an2_copy_engines.json
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; synth_q30; }
date -u
timeout $((330 - SECONDS)) $OFFLOAD_SWEEP --batch 1 --repeats 2 \
  --variants "gates:GATES=1;replace:$R;replace_w1:$R,WINDOW=1;replace_d3:$R,DEPTH=3;replace_d3_w1:$R,DEPTH=3,WINDOW=1;replace_d4:$R,DEPTH=4" \
  2>$OUT/an2_b1.err | tee $OUT/an2_b1.jsonl
date -u
timeout $((420 - SECONDS)) $OFFLOAD_SWEEP --batch 1 --repeats 1 --trace /tmp/tr \
  --variants "gates:GATES=1;replace_d3:$R,DEPTH=3" 2>$OUT/an2_trace.err | tee $OUT/an2_trace.jsonl
python3 scripts/compact_traces.py /tmp/compact /tmp/tr/*/*.trace.json && tar -cf $OUT/an2_traces.tar -C /tmp compact
date -u
timeout $((575 - SECONDS)) $OFFLOAD_SWEEP --batch 4 --repeats 2 \
  --variants "stop:GATES=0;gates:GATES=1;replace:$R;replace_d3:$R,DEPTH=3" 2>$OUT/an2_b4.err | tee $OUT/an2_b4.jsonl
date -u
} 2>&1 | tee $OUT/round_an2.log

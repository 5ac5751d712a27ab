#!/usr/bin/env bash
# GPU round AN, first call: does the copy engine serve two streams' copies in order (probe), and
# does keeping it fed between two routings (FT_TOP_UP=1: the host queues held guesses while it
# waits for the next cut's rows) or letting a nearer guess replace a held one (FT_HELD=replace)
# shorten the b1 step, with device gates or host stops? Both plain are the references, one process.
# (Run when host stops were offload's default; `stop` now says GATES=0 to stay host stops.
# FT_TOP_UP and FT_HELD, and FT_EVICT_LATE, were this round's switches: the first two are now
# what --moe-gates does, the last was removed.)
set -u
source scripts/gpu_env.sh
{
date -u
python3 scripts/probe_copy_engines.py | tee $OUT/an_copy_engines.json
FT_TOP_UP=1 FT_HELD=replace timeout 120 python3 -m pytest -q -m gpu tests/engine/test_zero_copy.py tests/engine/test_graphs.py 2>&1 | tail -3
date -u
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; synth_q30; }
date -u
timeout $((570 - SECONDS)) python3 scripts/bench_sweep.py --model /tmp/q30 --strategy offload \
  --batch 1 --repeats 2 --tokens 32 --warmup 4 --cache-rate 0.15 $P \
  --variants "stop:GATES=0;gates:GATES=1;stop_topup:GATES=0,FT_TOP_UP=1;topup:GATES=1,FT_TOP_UP=1;replace:GATES=1,FT_TOP_UP=1,FT_HELD=replace;replace_w1:GATES=1,WINDOW=1,FT_TOP_UP=1,FT_HELD=replace" \
  2>$OUT/an_sweep.err | tee $OUT/an_sweep.jsonl
date -u
} 2>&1 | tee $OUT/round_an.log

#!/usr/bin/env bash
# GPU round AM, third call: the gate shut at every layer until the host has followed it, and the
# host then free to take any other layer's slots (LRU, as host stops do; rounds AM and AM2 took
# them only from layers the GPU had finished, which starved the first layers: 76 misses a b1
# step against 6.7), against host stops; then `ft bench decode` of the gated step alone.
# (FT_ZERO_COPY_MISSES=gate was the round's switch, since removed: it is `--moe-gates` now.)
set -u
source scripts/gpu_env.sh
{
date -u
FT_ZERO_COPY_MISSES=gate timeout 100 python3 -m pytest -q -m gpu tests/engine/test_zero_copy.py -k "cuda" 2>&1 | tail -3
date -u
pkill -f "python3 -m [f]t model" && sleep 3
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; df -h / | tail -1; synth_q30; }
date -u
timeout 260 python3 scripts/bench_sweep.py --model /tmp/q30 --strategy offload \
  --batch 1,4 --repeats 2 --tokens 32 --warmup 4 --cache-rate 0.15 $P \
  --variants "stop:;zcg2:ZC=1,WINDOW=2,FT_ZERO_COPY_MISSES=gate;zcg4:ZC=1,WINDOW=4,FT_ZERO_COPY_MISSES=gate" \
  2>$OUT/am3_sweep.err | tee $OUT/am3_sweep.jsonl
date -u
FT_ZERO_COPY_MISSES=gate timeout $((590 - SECONDS)) python3 -m ft bench decode --model /tmp/q30 \
  --strategies offload --moe-zero-copy --moe-prefetch-window 2 --moe-cache-rate 0.15 --batch 1,4 \
  --tokens 32 --warmup 4 $P --json > $OUT/am3_bench.json 2>$OUT/am3_bench.err
show $OUT/am3_bench.json
date -u
} 2>&1 | tee $OUT/round_am3.log

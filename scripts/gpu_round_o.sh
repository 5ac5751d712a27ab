#!/usr/bin/env bash
# GPU round O (issue 7): the whole decode step as one graph waiting at device gates (round N
# queued the stretches one by one, and the per-stretch launches kept the host the bottleneck).
#   1. the GPU tests of graphs, the cache and hybrid (gated and not: tokens as eager), while the
#      48-layer preset is written
#   2. scripts/bench_stop_phases.py: the host's time per MoE layer by phase, gates on and off
#   3. ft bench decode: offload and hybrid gated at b1 and b4; offload without gates at b1
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
B="python3 -m ft bench decode --model /tmp/q30 --tokens 16 --warmup 3 $P --json --moe-cache-rate 0.15"
{
date -u
timeout 150 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 > /tmp/synth.log 2>&1 &
timeout 150 python3 -m pytest -q -m gpu -o timeout=60 tests/engine/test_graphs.py \
  tests/engine/test_expert_cache.py tests/engine/test_hybrid.py 2>&1 | tail -6; echo
wait; tail -1 /tmp/synth.log
timeout 150 python3 scripts/bench_stop_phases.py --model /tmp/q30 --tokens 32 2>/tmp/phases.err | tee $OUT/o-phases.jsonl
tail -2 /tmp/phases.err
FT_DECODE_GATES=1 timeout 150 $B --strategies offload,hybrid --batch 1,4 > $OUT/o-gates.json 2>$OUT/o-gates.err
echo "== gates on (rc $?)"; show $OUT/o-gates.json; tail -2 $OUT/o-gates.err
FT_DECODE_GATES=0 timeout 100 $B --strategies offload --batch 1 > $OUT/o-nogates.json 2>/dev/null
echo "== gates off"; show $OUT/o-nogates.json
date -u
} 2>&1 | tee $OUT/round_o.log
